"""Signals to a real `easyrl train` process: the same exit codes from start-up on, and a hung in-process reward
does not delay SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, base_config, write_config


pytestmark = pytest.mark.slow

HANGING_REWARD = """
import time
REWARD_TYPE = "sequential"

def main(x, marker):
    open(marker, "w").close()
    time.sleep(3600)
"""


def _start(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "easyrl.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} first: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"{path} not written in {limit_s} s"
        time.sleep(0.1)


def test_sigterm_during_a_hung_in_process_reward(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    reward = tmp_path / "hang.py"
    reward.write_text(HANGING_REWARD)
    marker = tmp_path / "reward_called"
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"].update(
        {
            "reward_function": f"{reward}:main",
            "reward_function_kwargs": {"marker": str(marker)},
            "num_workers": 0,
            "timeout_s": 600.0,
        }
    )
    proc = _start(["train", write_config(tmp_path / "cfg.yaml", conf)])
    try:
        _wait_for(marker, proc, 300)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # once: the first signal asks for a clean stop
        code = proc.wait(timeout=120)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM after step 0" in stderr
    assert elapsed < 30.0, f"took {elapsed:.1f} s to stop"


@pytest.mark.parametrize(
    ("trigger", "signum"),
    [
        ("algorithm:", signal.SIGTERM),  # the config is loaded; torch and the trainer are being imported
        ("loading tokenizer", signal.SIGINT),
        ("starting Ray", signal.SIGTERM),  # lands in ray.init, which installs its own SIGTERM handler
        ("loading models into the workers", signal.SIGTERM),  # Ray and the worker processes are up
    ],
)
def test_signal_during_start_up(tmp_path: Path, tiny_model_dir: str, digits_data, trigger: str, signum: int) -> None:
    """Before the trainer's stop handlers exist a signal gave exit 15, -15, 1 or a traceback; now 143 / 130."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    proc = _start(["train", write_config(tmp_path / "cfg.yaml", conf)])
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if trigger in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(300), "".join(lines)[-3000:]
        proc.send_signal(signum)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert code == 128 + signum, (code, stderr[-3000:])
    assert f"stopped by {signal.Signals(signum).name}" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
