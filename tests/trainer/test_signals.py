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
    assert "stopped by SIGTERM after step 0; no checkpoint to resume from, so the same command starts again" in stderr
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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hangup_of_the_process_group_stops_saves_and_cleans_up(
    tmp_path: Path, tiny_model_dir: str, digits_data
) -> None:
    """A closed SSH session sends SIGHUP to the job's whole process group: driver, Ray's services and workers and
    the reward workers. Before, the driver died at once (exit -1, no line, no save) and Ray's agents outlived it;
    now it stops like SIGTERM (exit 129, one line, the checkpoint of the last step) and takes everything with it."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["trainer"].update({"save_freq": -1, "save_on_interrupt": True, "max_steps": 50})
    conf["worker"]["reward"]["num_workers"] = 1  # a reward worker process is in the group too
    log = tmp_path / "run" / "experiment_log.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "easyrl.cli", "train", write_config(tmp_path / "cfg.yaml", conf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job of a login shell has
    )
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no step was logged in 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGHUP)
        code = proc.wait(timeout=120)
        stderr = proc.stderr.read() if proc.stderr else ""
        deadline = time.monotonic() + 60  # Ray's processes end after the driver's shutdown of them
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(proc.pid), "processes of the run outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGHUP, stderr[-3000:]
    assert "stopped by SIGHUP after step" in stderr, stderr[-3000:]
    step = int((tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text())
    assert step >= 1 and (tmp_path / "run" / f"global_step_{step}" / "COMPLETE").exists()
