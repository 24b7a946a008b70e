"""`easyrl.config.diffusion_run.is_diffusion_run`: a diffusers folder (its model_index.json) makes
a run a diffusion run unless `worker.rollout.diffusion.enable` says otherwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from easyrl.config.diffusion import DiffusionConfig
from easyrl.config.diffusion_run import is_diffusion_run


def config(model_path: str, enable: bool | None) -> Any:
    """The two keys `is_diffusion_run` reads, shaped as the config's sections."""
    rollout = SimpleNamespace(diffusion=DiffusionConfig(enable=enable))
    actor = SimpleNamespace(model=SimpleNamespace(model_path=model_path))
    return SimpleNamespace(worker=SimpleNamespace(rollout=rollout, actor=actor))


def test_enable_overrides_the_detection_either_way(tmp_path: Path, tiny_model_dir: str) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert is_diffusion_run(config(str(tmp_path), None)) and not is_diffusion_run(config(tiny_model_dir, None))
    assert not is_diffusion_run(config(str(tmp_path), False)) and is_diffusion_run(config(tiny_model_dir, True))
