"""Checkpoint metadata is read only from regular files of bounded size: a FIFO, `/dev/zero` or a huge file planted
in a run folder is one line naming the file, never a read that blocks or fills memory (issue 45, item 4)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from easyrl.checkpoint import CheckpointError, CheckpointManager, read_run_config, read_trainer_state
from easyrl.checkpoint.fsio import read_json, read_tensor_metadata
from easyrl.checkpoint.lock import LOCK_FILE, RunLock
from easyrl.checkpoint.manager import RUN_CONFIG, TRACKER, TRAINER_STATE, is_complete


def _unblock(fifo: Path) -> None:
    """Give a reader stuck opening `fifo` (the code before the fix) an end of file, so a failing test ends."""
    with contextlib.suppress(OSError):  # no reader waiting: nothing to unblock
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _within(seconds: float, fn: Callable[[], Any], fifo: Path | None = None) -> Any:
    """`fn()` run in a thread that must finish within `seconds`; returns its value or re-raises its error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    if hung and fifo is not None:
        _unblock(fifo)
        thread.join(5)
    assert not hung, f"{fn} still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_fifo_as_trainer_state_is_named_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / TRAINER_STATE
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=rf"{TRAINER_STATE} is a FIFO, not a regular file: refusing to read"):
        _within(10, lambda: read_trainer_state(str(tmp_path)), fifo)


def test_fifo_as_run_config_is_named_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / RUN_CONFIG
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=rf"{RUN_CONFIG} is a FIFO"):
        _within(10, lambda: read_run_config(str(tmp_path)), fifo)


def test_dev_zero_as_metadata_is_named(tmp_path: Path) -> None:
    (tmp_path / "m.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"m\.json is a character device, not a regular file"):
        _within(10, lambda: read_json(str(tmp_path / "m.json")))
    (tmp_path / "rng.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"rng\.safetensors is a character device"):
        _within(10, lambda: read_tensor_metadata(str(tmp_path / "rng.safetensors")))


def test_huge_metadata_file_is_refused_by_size_before_reading(tmp_path: Path) -> None:
    path = tmp_path / RUN_CONFIG
    with open(path, "wb") as handle:
        handle.truncate(300 << 20)  # sparse: 300 MiB that cost no disk
    with pytest.raises(CheckpointError, match=rf"{RUN_CONFIG} is 314572800 bytes, more than the 268435456"):
        read_run_config(str(tmp_path))
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"a": 1}))
    assert read_json(str(small), cap=64) == {"a": 1}
    with pytest.raises(CheckpointError, match="more than the 4 a metadata file"):
        read_json(str(small), cap=4)


def test_fifo_tracker_falls_back_to_the_newest_complete_with_a_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(str(tmp_path))
    fifo = tmp_path / TRACKER
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        assert _within(10, manager.latest, fifo) is None
    assert f"ignoring the checkpoint tracker {fifo}" in caplog.text and "is a FIFO" in caplog.text


def test_fifo_listed_in_a_manifest_is_not_complete(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "shard.safetensors")
    manifest = {"files": {"shard.safetensors": {"size": 0, "sha256": "0" * 64}}, "step": 1}
    (tmp_path / "COMPLETE").write_text(json.dumps(manifest))
    assert (
        _within(10, lambda: is_complete(str(tmp_path), verify_checksums=True), tmp_path / "shard.safetensors") is False
    )


def test_fifo_as_run_lock_is_named(tmp_path: Path) -> None:
    fifo = tmp_path / LOCK_FILE
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=rf"{LOCK_FILE} is not a regular file .*: remove it"):
        _within(10, RunLock(str(tmp_path)).acquire, fifo)
