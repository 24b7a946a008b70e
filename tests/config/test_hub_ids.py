"""Hub IDs for models and datasets resolve offline through a Hugging Face cache built in a temp dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, load_config
from easyrl.config.hub import is_hub_id
from tests.conftest import base_config, write_config


REV = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(hub: Path, kind: str, repo_id: str, files: dict[str, Path | str]) -> Path:
    """huggingface_hub's cache layout: <kind>s--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    for name, source in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            shutil.copy(source, target)
        else:
            target.write_text(source)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf_home"
    hub = home / "hub"
    model_files = {p.name: p for p in Path(tiny_model_dir).iterdir() if p.is_file()}
    _cache_repo(hub, "model", "tiny-org/tiny-qwen", model_files)
    rows = [{"prompt": f"Copy: {i}", "answer": str(i)} for i in range(8)]
    _cache_repo(
        hub,
        "dataset",
        "tiny-org/digits",
        {
            "data/train-00000-of-00001.jsonl": "".join(json.dumps(r) + "\n" for r in rows),
            "data/test-00000-of-00001.jsonl": "".join(json.dumps(r) + "\n" for r in rows[:2]),
            "README.md": "tiny",
        },
    )
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    monkeypatch.chdir(tmp_path)
    return home


def _conf(tmp_path: Path, tiny_model_dir: str, **data: Any) -> str:
    conf = base_config("tiny-org/tiny-qwen", {"train": "tiny-org/digits@train"}, tmp_path / "run")
    conf["data"].update(data)
    return write_config(tmp_path / "hub.yaml", conf)


def test_model_and_dataset_ids_resolve_from_the_cache(hf_home: Path, tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = load_config(_conf(tmp_path, tiny_model_dir, val_files="tiny-org/digits@test"))
    model_snapshot = str(hf_home / "hub" / "models--tiny-org--tiny-qwen" / "snapshots" / REV)
    data_snapshot = str(hf_home / "hub" / "datasets--tiny-org--digits" / "snapshots" / REV)
    assert cfg.worker.actor.model.model_path == model_snapshot
    assert cfg.worker.actor.model.tokenizer_path == model_snapshot
    assert cfg.worker.critic.model.model_path == model_snapshot
    assert cfg.data.train_files == f"{data_snapshot}@train"
    assert cfg.data.val_files == f"{data_snapshot}@test"
    from easyrl.data.loading import load_rows

    assert len(load_rows(cfg.data.train_files)) == 8 and len(load_rows(cfg.data.val_files)) == 2


def test_dataset_id_without_split_takes_train(hf_home: Path, tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = load_config(_conf(tmp_path, tiny_model_dir), ["data.train_files=tiny-org/digits"])
    assert cfg.data.train_files.endswith(f"datasets--tiny-org--digits/snapshots/{REV}@train")


def test_dataset_id_from_the_datasets_cache(hf_home: Path, tmp_path: Path, tiny_model_dir: str) -> None:
    """A dataset loaded before with `datasets.load_dataset` (so prepared in the datasets cache, not in the hub
    cache) resolves offline too: datasets' cache layout <org>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow."""
    import datasets

    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps({"problem": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    builder = datasets.load_dataset_builder("json", data_files={"train": str(source)}, cache_dir=str(tmp_path / "b"))
    builder.download_and_prepare()
    prepared = next((tmp_path / "b").glob("json/*/0.0.0/*/dataset_info.json")).parent
    target = hf_home / "datasets" / "tiny-org___cached-only" / "default" / "0.0.0" / REV
    target.mkdir(parents=True)
    info = json.loads((prepared / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "dataset_name": "cached-only"}))
    shutil.copy(prepared / "json-train.arrow", target / "cached-only-train.arrow")
    cfg = load_config(_conf(tmp_path, tiny_model_dir), ["data.train_files=tiny-org/cached-only@train"])
    assert cfg.data.train_files.startswith(str(hf_home / "datasets" / "easyrl" / "tiny-org___cached-only" / "train-"))
    from easyrl.data.loading import load_rows

    assert [row[2]["problem"] for row in load_rows(cfg.data.train_files)] == [f"q{i}" for i in range(5)]


def test_local_path_wins_over_the_hub(hf_home: Path, tmp_path: Path, tiny_model_dir: str) -> None:
    local = tmp_path / "tiny-org" / "tiny-qwen"
    shutil.copytree(tiny_model_dir, local)
    cfg = load_config(_conf(tmp_path, tiny_model_dir))
    assert cfg.worker.actor.model.model_path == str(local)


@pytest.mark.parametrize(
    ("override", "key", "command"),
    [
        ("worker.actor.model.model_path=tiny-org/not-cached", "worker.actor.model.model_path", "hf download "),
        ("data.train_files=tiny-org/not-cached@train", "data.train_files", "--repo-type dataset"),
    ],
)
def test_offline_missing_id_stops_with_one_line(
    hf_home: Path, tmp_path: Path, tiny_model_dir: str, override: str, key: str, command: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_conf(tmp_path, tiny_model_dir), [override])
    message = str(info.value)
    assert message.startswith(f"{key}: tiny-org/not-cached is not in the Hugging Face cache ({hf_home / 'hub'})")
    if key.startswith("data."):
        assert f"nor in the datasets cache ({hf_home / 'datasets'})" in message
    assert "HF_HUB_OFFLINE is set" in message and f"{command}" in message and "tiny-org/not-cached" in message
    assert "\n" not in message


def test_what_counts_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("hiyouga/math12k")
    for local in ("data/train.jsonl", "./org/name", "/abs/org/name", "name", "a/b/c", "data/train.parquet"):
        assert not is_hub_id(local), local
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # exists locally
