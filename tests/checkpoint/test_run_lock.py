"""One run per run folder: a second `easyrl train` on a held folder stops with one line naming the folder and the
holder; a lock left by a killed run is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from easyrl.checkpoint.lock import LOCK_FILE, RunLock, RunLockedError, _start_time
from tests.conftest import base_config, write_config


HOLD = (
    "import sys, time\n"
    "from easyrl.checkpoint.lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)
TAKE = "import sys\nfrom easyrl.checkpoint.lock import RunLock\nRunLock(sys.argv[1]).acquire().release()\n"


def _holder(run: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_second_train_on_a_held_folder_stops_naming_the_holder(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        path = write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, run))
        proc = subprocess.run(
            [sys.executable, "-m", "easyrl.cli", "train", path], capture_output=True, text=True, timeout=300
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert str(run) in last and f"pid {holder.pid} on host {socket.gethostname()}" in last, last
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(run)) == [LOCK_FILE], "the second run wrote into the held folder"


def test_lock_of_a_killed_run_is_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _holder(run)
    with pytest.raises(RunLockedError, match=f"pid {holder.pid} on host"):
        RunLock(str(run)).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid  # the dead run's record is still there
    proc = subprocess.run([sys.executable, "-c", TAKE, str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"taking over the stale lock of pid {holder.pid}" in proc.stderr


def test_recorded_live_holder_is_refused_where_flock_is_not_enforced(tmp_path: Path) -> None:
    """The second guard: a lock file naming a live process on this host (pid and start time) is refused even when
    the flock itself is free; one naming a process that has exited is taken over."""
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record = {"pid": sleeper.pid, "host": socket.gethostname(), "start_time": _start_time(sleeper.pid)}
        (run / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(RunLockedError, match=f"pid {sleeper.pid}"):
            RunLock(str(run)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = RunLock(str(run)).acquire()  # the recorded process is gone: stale
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (run / LOCK_FILE).read_text() == ""
    RunLock(str(run)).acquire().release()  # released: free again
