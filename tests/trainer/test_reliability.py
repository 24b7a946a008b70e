"""Dead workers and signals: clean, fast exits that name the culprit, and a re-launch that resumes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from easyrl.checkpoint import is_complete
from easyrl.config import load_config_and_secrets
from tests.conftest import base_config, write_config


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
KILLS = int(os.environ.get("EASYRL_TEST_KILLS", "3"))  # 3 fit `make test`'s time budget; `make test-extended`: 10


def _config(tmp_path: Path, model: str, data: dict[str, str], **trainer: object) -> str:
    conf = base_config(model, data, tmp_path / "run")
    conf["algorithm"].update({"disable_kl": False, "use_kl_loss": True})  # two roles: actor and ref
    conf["trainer"].update({"max_steps": 1000, "total_epochs": 100, "save_freq": 1, "save_limit": 2, **trainer})
    return write_config(tmp_path / "cfg.yaml", conf)


def test_killed_worker_stops_the_driver_and_relaunch_resumes(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    """`ray.kill` of a random worker, KILLS times: each time the driver raises WorkerDiedError naming the role
    within 60 s, the newest checkpoint is complete, and a re-launch resumes from it."""
    _kill_and_relaunch(KILLS, tmp_path, tiny_model_dir, digits_data)


@pytest.mark.extended  # ten kills, as issue 6 asked: `make test-extended`
def test_ten_killed_workers_each_stop_the_driver_and_relaunch_resumes(
    tmp_path: Path, tiny_model_dir, digits_data
) -> None:
    _kill_and_relaunch(10, tmp_path, tiny_model_dir, digits_data)


def _kill_and_relaunch(kills: int, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> None:
    from easyrl.distributed import WorkerDiedError
    from easyrl.trainer.trainer import Trainer

    rng = random.Random(0)
    cfg, secrets = load_config_and_secrets(_config(tmp_path, tiny_model_dir, digits_data))
    clean_exits, resumed_steps = 0, []
    for attempt in range(kills):
        trainer = Trainer(cfg, secrets)
        start_step = trainer.global_step
        if attempt:
            resumed_steps.append(start_step)
        role = rng.choice(["actor", "ref"])
        group = trainer.actor if role == "actor" else trainer.ref
        rank = rng.randrange(group.world_size)
        killed_at: list[float] = []

        def kill(group=group, rank=rank, trainer=trainer, start_step=start_step, killed_at=killed_at) -> None:
            import ray

            while trainer.global_step < start_step + 2:  # let one step finish (and save), the next begin
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.5))
            killed_at.append(time.monotonic())
            ray.kill(group._actors[rank], no_restart=True)

        thread = threading.Thread(target=kill, daemon=True)
        thread.start()
        try:
            with pytest.raises(WorkerDiedError) as info:
                trainer.fit()
            detected = time.monotonic() - killed_at[0]
            assert f"the {role} worker of rank {rank} died" in str(info.value), str(info.value)
            assert detected < 60.0, f"took {detected:.1f} s to notice"
            clean_exits += 1
        finally:
            thread.join(timeout=5)
            trainer.close()
        latest = trainer.ckpt.latest()
        assert latest is not None and is_complete(latest)
    assert clean_exits == kills
    assert resumed_steps and all(step >= 1 for step in resumed_steps), resumed_steps
    assert resumed_steps == sorted(resumed_steps)  # every re-launch continued from the newest checkpoint


def test_sigterm_stops_within_30s_and_saves(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    path = _config(tmp_path, tiny_model_dir, digits_data, save_freq=-1, save_on_interrupt=True)
    log = tmp_path / "run" / "experiment_log.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "easyrl.cli", "train", path],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no step was logged in 300 s"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 128 + signal.SIGTERM, stderr[-2000:]
    assert elapsed < 30.0, f"took {elapsed:.1f} s to stop"
    assert "stopped by SIGTERM" in stderr
    last = json.loads(log.read_text().splitlines()[-1])["step"]
    tracker = (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(tracker) == last, (tracker, last)
    assert (tmp_path / "run" / f"global_step_{last}" / "COMPLETE").exists()
    # the stop line says what running the command again does
    assert (
        f"stopped by SIGTERM after step {last}; the same command resumes from {tmp_path}/run/global_step_{last}\n"
        in stderr
    )
