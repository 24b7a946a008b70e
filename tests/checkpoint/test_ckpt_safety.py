"""Planted pickle payloads are refused with CheckpointError and never run; merge refuses incomplete checkpoints."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from easyrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMixin,
    read_trainer_state,
    write_trainer_state,
)
from easyrl.checkpoint.manager import MANIFEST, is_complete
from easyrl.config import EasyRLConfig
from easyrl.merge import main as merge_main
from easyrl.merge import merge_checkpoint


class Payload:
    """Unpickling this creates `marker` (stands in for arbitrary code execution)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class Worker(CheckpointMixin):
    def __init__(self, model_dir: str) -> None:
        self.cfg = EasyRLConfig()
        self.cfg.worker.actor.model.model_path = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        ids = torch.randint(0, 90, (2, 6))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.scheduler.step()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from easyrl.testing.tiny import build_tiny_checkpoint

    base = tmp_path_factory.mktemp("cks")
    model_dir = build_tiny_checkpoint(base / "m", hidden_size=32, num_layers=1, intermediate_size=64)
    worker = Worker(model_dir)
    manager = CheckpointManager(str(base / "run"), save_limit=-1)
    tmp = manager.begin(1)
    worker.save_checkpoint(os.path.join(tmp, "actor"), False)
    write_trainer_state(tmp, {"global_step": 1})
    return {"folder": manager.commit(tmp, 1), "worker": worker}


def payloads(marker: str) -> dict[str, bytes]:
    raw = pickle.dumps(Payload(marker))
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)  # the zip container torch.load would unpickle
    return {"pickle": raw, "torch_save": buffer.getvalue()}


def reseal(folder: str) -> None:
    """Rewrite the manifest so the planted file also passes the completeness check (a deliberate attacker)."""
    manager = CheckpointManager(os.path.dirname(folder), save_limit=-1)
    os.remove(os.path.join(folder, MANIFEST))
    tmp = manager.begin(99)
    os.rmdir(tmp)
    shutil.copytree(folder, tmp)
    shutil.rmtree(folder)
    manager.commit(tmp, int(folder.rsplit("_", 1)[1]))


def test_payload_really_runs_when_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(payloads(str(marker))["pickle"])  # the control: this payload is live
    assert marker.exists()


TARGETS = [
    "actor/model_rank0_of1.safetensors",
    "actor/optim_rank0_of1.safetensors",
    "actor/optim_rank0.json",
    "actor/scheduler.json",
    "actor/rng_rank0.safetensors",
    "actor/rng_rank0.json",
    "actor/meta.json",
    "trainer_state.json",
    "trainer_rng.safetensors",
]


@pytest.mark.parametrize("kind", ["pickle", "torch_save"])
@pytest.mark.parametrize("target", TARGETS)
def test_planted_payload_is_refused(checkpoint: dict[str, Any], tmp_path: Path, target: str, kind: str) -> None:
    folder = str(tmp_path / "run" / "global_step_1")  # merge outputs go outside the run folder
    shutil.copytree(checkpoint["folder"], folder)
    marker = tmp_path / "ran"
    (Path(folder) / target).write_bytes(payloads(str(marker))[kind])
    assert not is_complete(folder)  # the size changed
    reseal(folder)
    assert is_complete(folder)
    with pytest.raises(CheckpointError, match=os.path.basename(target).replace(".", r"\.")):
        if target.startswith("actor/"):
            checkpoint["worker"].load_checkpoint(os.path.join(folder, "actor"))
        else:
            read_trainer_state(folder)
    if target.startswith("actor/model") or target.endswith("meta.json"):
        with pytest.raises(CheckpointError, match=os.path.basename(target).replace(".", r"\.")):
            merge_checkpoint(folder, str(tmp_path / "merged"))
        assert merge_main([folder, "-o", str(tmp_path / "merged2")]) == 1
    assert not marker.exists()


def test_merge_refuses_incomplete_and_missing(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    folder = tmp_path / "global_step_1"
    shutil.copytree(checkpoint["folder"], folder)
    (folder / "actor" / "model_rank0_of1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model_rank0_of1\.safetensors is missing"):
        merge_checkpoint(str(folder))
    assert merge_main([str(folder / "actor")]) == 1
    assert merge_main([str(tmp_path / "nope")]) == 1
    assert not (folder / "actor" / "huggingface_merged").exists()


def test_merge_refuses_existing_output_and_splits_shards(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert merge_main([checkpoint["folder"], "-o", str(out), "--max-shard-size-gb", "0.00002"]) == 0
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    assert merge_main([checkpoint["folder"], "-o", str(out)]) == 1
    assert merge_main([checkpoint["folder"], "-o", str(out), "--overwrite", "--dtype", "fp16"]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.float16 and (out / "model.safetensors").exists()
    assert not (out / "model.safetensors.index.json").exists()
    expected = checkpoint["worker"].model.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name].half())
