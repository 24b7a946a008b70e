"""Corrupted checkpoints are refused by name: SHA-256 per file in the manifest, steps checked against the folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from easyrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMixin,
    verify_checkpoint,
    write_trainer_state,
)
from easyrl.checkpoint.manager import MANIFEST, read_manifest
from easyrl.config import EasyRLConfig
from easyrl.merge import main as merge_main
from tests.conftest import base_config, write_config


SHARD = "actor/model_rank0_of1.safetensors"


class Worker(CheckpointMixin):
    def __init__(self, model_dir: str) -> None:
        self.cfg = EasyRLConfig()
        self.cfg.worker.actor.model.model_path = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run root with two resumable checkpoints (steps 1 and 2), saved as the trainer saves them."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    base = tmp_path_factory.mktemp("integrity")
    model_dir = build_tiny_checkpoint(base / "m", hidden_size=32, num_layers=1, intermediate_size=64)
    worker = Worker(model_dir)
    manager = CheckpointManager(str(base / "run"), save_limit=-1)
    for step in (1, 2):
        tmp = manager.begin(step)
        worker.save_checkpoint(os.path.join(tmp, "actor"), False)
        write_trainer_state(tmp, {"global_step": step})
        manager.commit(tmp, step)
    return {"root": base / "run", "model_dir": model_dir}


@pytest.fixture
def root(saved: dict[str, Any], tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved["root"], copy)
    return copy


def write_nans_in_place(path: Path) -> None:
    """Overwrite the tensor data of a safetensors file with float32 NaNs, keeping its header and its size."""
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    start = 8 + header_len
    nan = struct.pack("<f", float("nan"))
    raw[start:] = (nan * ((len(raw) - start) // 4 + 1))[: len(raw) - start]
    size = path.stat().st_size
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == size


def test_manifest_records_a_sha256_per_file(root: Path) -> None:
    manifest = read_manifest(str(root / "global_step_2"))
    assert manifest is not None
    files = manifest["files"]
    assert SHARD in files and "trainer_state.json" in files
    assert all(len(entry["sha256"]) == 64 for entry in files.values())
    verify_checkpoint(str(root / "global_step_2"))  # an intact checkpoint passes


def test_nan_shard_of_the_same_size_is_refused_by_merge(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = root / "global_step_2"
    write_nans_in_place(folder / SHARD)
    with caplog.at_level(logging.ERROR):
        assert merge_main([str(folder), "-o", str(root.parent / "merged")]) == 1
    assert "model_rank0_of1.safetensors does not match the SHA-256" in caplog.text
    assert not (root.parent / "merged").exists()
    # --no-verify is the documented escape hatch for huge checkpoints: it says so in the log, and merges.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert merge_main([str(folder), "-o", str(root.parent / "merged"), "--no-verify"]) == 0
    assert "--no-verify: the checksums" in caplog.text


def test_nan_shard_of_the_same_size_is_refused_by_resume(root: Path) -> None:
    manager = CheckpointManager(str(root), save_limit=-1)
    write_nans_in_place(root / "global_step_2" / SHARD)
    with pytest.raises(CheckpointError, match=r"model_rank0_of1\.safetensors does not match the SHA-256"):
        manager.resolve_load(str(root / "global_step_2"), find_last=True)
    with pytest.raises(CheckpointError, match=r"newest checkpoint .*global_step_2 is corrupt") as info:
        manager.resolve_load(None, find_last=True)
    message = str(info.value)
    assert "model_rank0_of1.safetensors" in message and "global_step_1" in message
    assert "trainer.fallback_to_older_checkpoint" in message


def test_older_checkpoint_used_only_when_allowed(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(str(root), save_limit=-1)
    write_nans_in_place(root / "global_step_2" / SHARD)
    with caplog.at_level(logging.ERROR):
        chosen = manager.resolve_load(None, find_last=True, fallback=True)
    assert chosen == str(root / "global_step_1")
    assert f"resuming from the older checkpoint {root / 'global_step_1'} instead of the corrupt" in caplog.text
    assert str(root / "global_step_2") in caplog.text
    write_nans_in_place(root / "global_step_1" / SHARD)
    with pytest.raises(CheckpointError, match="no older one is intact"):
        manager.resolve_load(None, find_last=True, fallback=True)


def test_edited_global_step_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(str(root), save_limit=-1)
    state = root / "global_step_2" / "trainer_state.json"
    doc = json.loads(state.read_text())
    doc["state"]["global_step"] = 9
    state.write_text(json.dumps(doc, indent=1, sort_keys=True))  # "2" -> "9": the same size
    with pytest.raises(CheckpointError, match=r"trainer_state\.json has global_step 9, but the checkpoint is step 2"):
        manager.resolve_load(str(root / "global_step_2"), find_last=True)
    with pytest.raises(CheckpointError, match=r"newest checkpoint .*global_step_2 is corrupt"):
        manager.resolve_load(None, find_last=True)
    # Without checksums (trainer.verify_checkpoint=false) the step is still checked against the folder name.
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(CheckpointError, match=r"has global_step 9, but the checkpoint is step 2"),
    ):
        manager.resolve_load(str(root / "global_step_2"), find_last=True, verify=False)
    assert "trainer.verify_checkpoint=false" in caplog.text
    assert merge_main([str(root / "global_step_2"), "--no-verify", "-o", str(root.parent / "m")]) == 1


def test_renamed_folder_is_refused(root: Path) -> None:
    os.rename(root / "global_step_2", root / "global_step_7")
    with pytest.raises(CheckpointError, match=r"records step 2, but the folder is global_step_7"):
        verify_checkpoint(str(root / "global_step_7"), checksums=False)


def test_missing_file_is_named(root: Path) -> None:
    (root / "global_step_2" / "actor" / "optim_rank0.json").unlink()
    with pytest.raises(CheckpointError, match=r"optim_rank0\.json is missing"):
        verify_checkpoint(str(root / "global_step_2"))
    (root / "global_step_2" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"has no COMPLETE manifest"):
        verify_checkpoint(str(root / "global_step_2"))


def test_easyrl_train_refuses_a_corrupt_checkpoint(
    root: Path, saved: dict[str, Any], digits_data: dict[str, str], tmp_path: Path
) -> None:
    """The real CLI: a resume from a NaN-overwritten shard stops before any worker starts, naming the file."""
    write_nans_in_place(root / "global_step_2" / SHARD)
    cfg = base_config(saved["model_dir"], digits_data, root)
    cfg["trainer"]["n_gpus_per_node"] = 1  # the world size it was saved at: a change would be refused first
    config = write_config(tmp_path / "cfg.yaml", cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "easyrl.cli", "train", config], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "global_step_2 is corrupt" in proc.stderr and "model_rank0_of1.safetensors" in proc.stderr
