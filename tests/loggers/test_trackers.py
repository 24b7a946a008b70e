"""Each external tracker in its offline/local mode: log metrics, config and generations, then read them back."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from easyrl.config import Secrets
from easyrl.loggers import build_tracker
from easyrl.loggers.trackers import (
    TrackerNotInstalledError,
    build_external,
    flatten_config,
    mlflow_tracking_uri,
    swanlab_mode,
    wandb_mode,
)


CONFIG = {
    "data": {"max_prompt_length": 512, "train_files": "data/train.jsonl"},
    "trainer": {"logger": ["console", "wandb"], "project_name": "p"},
    "worker": {"reward": {"reward_function_kwargs": {"api_key": "***"}}},
}
STEPS = {1: {"reward/overall": 0.25, "actor/kl_loss": 0.01}, 2: {"reward/overall": 0.5, "actor/kl_loss": 0.02}}
ROWS = [
    {"prompt": "What is 1+1?", "response": "2", "ground_truth": "2", "score": 1.0},
    {"prompt": "Pipe | and\nnewline", "response": "wrong", "ground_truth": "x", "score": 0.0},
]
TRACKER_ENV = (
    "WANDB_API_KEY",
    "WANDB_MODE",
    "WANDB_BASE_URL",
    "SWANLAB_API_KEY",
    "SWANLAB_MODE",
    "MLFLOW_TRACKING_URI",
)


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No tracker credentials, a throwaway HOME (no ~/.netrc), quiet console capture."""
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "wandb-data"))
    return tmp_path / "run"


def _exercise(name: str, run_dir: Path) -> None:
    lg = build_external(name, str(run_dir), "easyrl-test", "exp")
    lg.log_config(CONFIG)
    for step, metrics in STEPS.items():
        lg.log_metrics(metrics, step)
    lg.log_generations(ROWS, 2)
    lg.close()


# ---------------------------------------------------------------------------------------------- tensorboard
def test_tensorboard(clean_env: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _exercise("tensorboard", clean_env)
    acc = EventAccumulator(str(clean_env / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    for key in ("reward/overall", "actor/kl_loss"):
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx({s: m[key] for s, m in STEPS.items()})
    tags = acc.Tags()["tensors"]
    config_text = acc.Tensors(next(t for t in tags if t.startswith("config")))[0].tensor_proto.string_val[0].decode()
    assert '"max_prompt_length": 512' in config_text
    gen_event = acc.Tensors(next(t for t in tags if t.startswith("val/generations")))[0]
    assert gen_event.step == 2
    table = gen_event.tensor_proto.string_val[0].decode()
    assert "What is 1+1?" in table and "Pipe \\| and<br>newline" in table
    plugins = acc.PluginTagToContent("hparams")  # the config as hparams
    assert plugins


# ---------------------------------------------------------------------------------------------- wandb
def _read_wandb_records(path: str) -> list[Any]:
    """The protobuf records of a `.wandb` file (a leveldb-style log: 7-byte file header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # end of the written part
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def test_wandb_offline(clean_env: Path) -> None:
    pytest.importorskip("wandb")
    assert wandb_mode() == "offline"
    _exercise("wandb", clean_env)
    files = glob.glob(str(clean_env / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, "expected one offline run"
    # wandb-core writes the transaction log in its own process: finish() can return before the last records land.
    deadline = time.monotonic() + 60
    records = _read_wandb_records(files[0])
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.5)
        records = _read_wandb_records(files[0])
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            assert history[step][key] == pytest.approx(value)
    assert config["data"]["max_prompt_length"] == 512
    assert config["worker"]["reward"]["reward_function_kwargs"]["api_key"] == "***"
    table_path = history[2]["val/generations/path"]
    table = json.loads((Path(files[0]).parent / "files" / table_path).read_text())
    assert table["columns"] == ["step", "prompt", "response", "ground_truth", "score"]
    assert [r[1] for r in table["data"]] == [r["prompt"] for r in ROWS]
    assert [r[4] for r in table["data"]] == [1.0, 0.0]


def test_wandb_mode_follows_env(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # wandb reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() is None
    monkeypatch.delenv("WANDB_API_KEY")
    netrc_file = Path(os.environ["HOME"]) / ".netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc_file.chmod(0o600)
    assert wandb_mode() is None


# ---------------------------------------------------------------------------------------------- swanlab
def _read_swanlab_records(path: Path) -> list[Any]:
    """The protobuf records of a `.swanlab` run file, through swanlab's own reader (what `swanlab sync` uses)."""
    store = pytest.importorskip("swanlab.sdk.internal.core_python.store")
    record_pb2 = pytest.importorskip("swanlab.proto.swanlab.record.v1.record_pb2")
    reader = store.DataStoreReader()
    reader.open(str(path))
    records = []
    try:
        while (raw := reader.scan()) is not None:
            rec = record_pb2.Record()
            rec.ParseFromString(raw)
            records.append(rec)
    finally:
        reader.close()
    return records


def test_swanlab_offline(clean_env: Path) -> None:
    pytest.importorskip("swanlab")
    import yaml

    assert swanlab_mode() == "offline"
    _exercise("swanlab", clean_env)
    runs = glob.glob(str(clean_env / "swanlog" / "run-*"))
    assert len(runs) == 1
    run = Path(runs[0])
    config = yaml.safe_load((run / "files" / "config.yaml").read_text())
    assert config["data"]["value"]["max_prompt_length"] == 512
    assert config["worker"]["value"]["reward"]["reward_function_kwargs"]["api_key"] == "***"
    scalars: dict[str, dict[int, float]] = {}
    media_keys = set()
    for rec in _read_swanlab_records(next(run.glob("*.swanlab"))):
        kind = rec.WhichOneof("record_type")
        if kind == "scalar":
            scalars.setdefault(rec.scalar.key, {})[rec.scalar.step] = rec.scalar.value.number
        elif kind == "media":
            media_keys.add((rec.media.key, rec.media.step))
    for key in ("reward/overall", "actor/kl_loss"):
        assert scalars[key] == pytest.approx({s: m[key] for s, m in STEPS.items()})
    assert {("val/generations", 2), ("val/generations_text", 2)} <= media_keys
    tables = [json.loads(p.read_text()) for p in run.glob("media/**/*.json")]
    table = next(t for t in tables if t.get("_swanLab") == "table")
    assert [c["field"] for c in table["colDefs"]] == ["step", "prompt", "response", "ground_truth", "score"]
    assert [r["prompt"] for r in table["rowData"]] == [r["prompt"] for r in ROWS]
    metadata = (run / "files" / "swanlab-metadata.json").read_text()
    assert sys.argv[0] not in metadata, "the command line must not be recorded"


def test_swanlab_mode_follows_env(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert swanlab_mode() == "offline"
    monkeypatch.setenv("SWANLAB_API_KEY", "k")
    assert swanlab_mode() == "online"
    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    assert swanlab_mode() == "disabled"


# ---------------------------------------------------------------------------------------------- mlflow
def test_mlflow_local(clean_env: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    _exercise("mlflow", clean_env)
    uri = mlflow_tracking_uri(str(clean_env))
    assert uri.startswith("sqlite:///") and str(clean_env / "mlruns") in uri
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("easyrl-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    for key in ("reward/overall", "actor/kl_loss"):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx({s: m[key] for s, m in STEPS.items()})
    assert run.data.params["data.max_prompt_length"] == "512"
    assert run.data.params["worker.reward.reward_function_kwargs.api_key"] == "***"
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "config.json")).read_text())
    assert config == CONFIG
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "generations/step_000002.json")).read_text())
    assert table["columns"] == ["step", "prompt", "response", "ground_truth", "score"]
    assert [r[1] for r in table["data"]] == [r["prompt"] for r in ROWS]


def test_mlflow_uri_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert mlflow_tracking_uri(str(tmp_path)) == "http://mlflow.example:5000"


# ---------------------------------------------------------------------------------------------- common
@pytest.mark.parametrize("name", ["tensorboard", "wandb", "swanlab", "mlflow"])
def test_missing_package_is_a_clear_error(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # makes `import <name>` raise ImportError
    with pytest.raises(TrackerNotInstalledError) as info:
        build_external(name, str(tmp_path), "p", "e")
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert f"trainer.logger has '{name}' but the {name} package is not installed" in message
    assert "pip install 'easyrl[loggers]'" in message and f"pip install {name}" in message


def test_unknown_logger(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown logger 'neptune'"):
        build_external("neptune", str(tmp_path), "p", "e")


def test_flatten_config() -> None:
    flat = flatten_config({"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "f": "x"})
    assert flat == {"a.b": 1, "a.c": "[1, 2]", "a.d": "null", "a.e": "{}", "f": "x"}


def test_build_tracker_fans_out(clean_env: Path) -> None:
    pytest.importorskip("tensorboard")
    tracker = build_tracker(["file", "tensorboard"], str(clean_env), "p", "e", total_steps=2, secrets=Secrets())
    tracker.log_config(CONFIG)
    tracker.log_metrics({"reward/overall": float("nan")}, 1)
    tracker.close()
    line = json.loads((clean_env / "experiment_log.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and math.isnan(line["reward/overall"])
    assert glob.glob(str(clean_env / "tensorboard" / "events.out.tfevents.*"))
