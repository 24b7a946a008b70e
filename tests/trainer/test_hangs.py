"""A frozen worker in a real `easyrl train` run: the run ends with one line naming the call, role and rank, every
rank's stack in the run folder; and SIGTERM is honoured while the driver waits on the frozen worker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, base_config, write_config


pytestmark = pytest.mark.slow

MARKING_REWARD = """
REWARD_TYPE = "sequential"

def main(x, marker):
    open(marker, "w").close()
    return 0.5
"""


def _start(tmp_path: Path, conf: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "easyrl.cli", "train", write_config(tmp_path / "cfg.yaml", conf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _config(tmp_path: Path, model_dir: str, data: dict[str, str], **trainer: Any) -> dict[str, Any]:
    reward = tmp_path / "mark.py"
    reward.write_text(MARKING_REWARD)
    conf = base_config(model_dir, data, tmp_path / "run")
    conf["worker"]["reward"].update(
        {"reward_function": f"{reward}:main", "reward_function_kwargs": {"marker": str(tmp_path / "scored")}}
    )
    conf["trainer"].update(trainer)
    return conf


def _freeze_an_actor_after_the_first_reward(proc: subprocess.Popen[str], marker: Path) -> psutil.Process:
    """SIGSTOP one actor worker of this run (a descendant of the driver: never another run's) once step 1 is scored."""
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} first: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
        assert time.monotonic() < deadline, "the first reward never came"
        time.sleep(0.05)
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ActorWorker" in " ".join(child.cmdline()):
                child.suspend()  # SIGSTOP
                return child
    pytest.fail("no actor worker among the driver's descendants")


def _finish(proc: subprocess.Popen[str], frozen: psutil.Process | None, limit_s: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        code = proc.wait(timeout=limit_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        if frozen is not None:
            with contextlib.suppress(psutil.Error):
                frozen.resume()
    return code, proc.stderr.read() if proc.stderr else "", time.monotonic() - start


def test_frozen_actor_ends_the_run_with_one_line_and_the_stacks(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    conf = _config(tmp_path, tiny_model_dir, digits_data, hang_timeout_s=5.0, max_steps=3)
    proc = _start(tmp_path, conf)
    frozen = _freeze_an_actor_after_the_first_reward(proc, tmp_path / "scored")
    code, stderr, elapsed = _finish(proc, frozen, 120)
    assert code == 1, stderr[-3000:]
    line = next((x for x in stderr.splitlines() if x.startswith("easyrl: WorkerFrozenError:")), "")
    assert "the actor worker of rank" in line and "is frozen" in line, stderr[-3000:]
    assert "Traceback" not in stderr
    reports = list((tmp_path / "run" / "hang_stacks").glob("hang-*.txt"))
    assert len(reports) == 1 and str(reports[0]) in line
    text = reports[0].read_text()
    assert f"(pid {frozen.pid}, stopped) ==\n(no stack" in text  # the frozen rank could not answer: said so
    assert text.count("== actor rank") == 2 and "== driver" in text
    assert elapsed < 5.0 + 30, f"took {elapsed:.1f} s"


def test_sigterm_while_the_driver_waits_on_a_frozen_actor(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    conf = _config(tmp_path, tiny_model_dir, digits_data, hang_timeout_s=600.0, stop_grace_s=1.0, max_steps=3)
    proc = _start(tmp_path, conf)
    frozen = _freeze_an_actor_after_the_first_reward(proc, tmp_path / "scored")
    time.sleep(2.0)  # the driver is now waiting on the actor's next call
    proc.send_signal(signal.SIGTERM)
    code, stderr, elapsed = _finish(proc, frozen, 120)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM: the call of" in stderr and "did not end within 1 s (trainer.stop_grace_s)" in stderr
    assert "Traceback" not in stderr
    assert elapsed < 30, f"took {elapsed:.1f} s to stop"
