"""`easyrl.config.diffusion`: detecting a diffusers pipeline, validating its keys and translating Long-RL's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easyrl.config.diffusion import is_diffusion_pipeline


def test_a_folder_is_a_pipeline_only_with_a_model_index(tmp_path: Path) -> None:
    assert not is_diffusion_pipeline(str(tmp_path)) and not is_diffusion_pipeline(None)
    (tmp_path / "config.json").write_text("{}")
    assert not is_diffusion_pipeline(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert is_diffusion_pipeline(str(tmp_path))


def test_a_hub_id_is_read_from_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache laid out as huggingface_hub lays it out: refs/main names the snapshot that holds the files.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--org--pipe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    assert not is_diffusion_pipeline("org/pipe")
    (repo / "snapshots" / "abc" / "model_index.json").write_text("{}")
    assert is_diffusion_pipeline("org/pipe")
    assert not is_diffusion_pipeline("org/not-cached-anywhere")
