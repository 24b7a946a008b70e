"""`trainer.backend: inline` end to end on CPU: the golden trajectory is bit-identical to Ray's, a worker's exception
names its role, SIGTERM saves and resume continues the curve exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, base_config, write_config
from tests.trainer.test_e2e import _VOLATILE, GOLDEN_EDITS, run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

ONE_WORKER = {"trainer.n_gpus_per_node": 1}


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows]


def test_golden_trajectory_is_bit_identical_inline_and_on_ray(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    """The golden run (GRPO with a KL loss to a reference: actor, rollout and ref roles) on one worker per role, five
    steps: every metric but wall-time ones equal (==) between Ray's worker processes and this process."""
    on_ray, _, ray_weights = run(
        tmp_path / "ray",
        tiny_model_dir,
        digits_data,
        {**GOLDEN_EDITS, **ONE_WORKER, "trainer.backend": "ray"},
        steps=5,
        weights=True,
    )
    inline, _, inline_weights = run(
        tmp_path / "inline",
        tiny_model_dir,
        digits_data,
        {**GOLDEN_EDITS, **ONE_WORKER, "trainer.backend": "inline"},
        steps=5,
        weights=True,
    )
    assert [r["step"] for r in inline] == [1, 2, 3, 4, 5]
    assert "actor/kl_loss" in inline[-1]  # the reference role ran
    assert _stable(inline) == _stable(on_ray)
    assert inline_weights is not None and ray_weights is not None
    assert all(inline_weights[name].equal(ray_weights[name]) for name in ray_weights)


LOSS_FAILS_AT_STEP_2 = """
from easyrl.algorithms import PpoParams, get_policy_loss, register_policy_loss

CALLS = [0]

@register_policy_loss("ppo_fails_at_step_2", params=PpoParams)
def ppo_fails_at_step_2(**kwargs):
    CALLS[0] += 1  # one worker, base config: 2 mini-batches x 2 micro-batches a step; call 5 is step 2's first
    if CALLS[0] == 5:
        raise FloatingPointError("the loss is not finite")
    return get_policy_loss("ppo")(**kwargs)
"""


def test_a_worker_exception_names_the_role_and_keeps_the_last_checkpoint(
    tmp_path: Path, tiny_model_dir, digits_data
) -> None:
    from easyrl.checkpoint import is_complete
    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import WorkerError
    from easyrl.trainer.trainer import Trainer

    plugin = tmp_path / "fails.py"
    plugin.write_text(LOSS_FAILS_AT_STEP_2)
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["user_modules"] = [str(plugin)]
    conf["worker"]["actor"]["loss_type"] = "ppo_fails_at_step_2"
    conf["trainer"].update({"max_steps": 3, "save_freq": 1, "n_gpus_per_node": 1, "backend": "inline"})
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit()
        latest = trainer.ckpt.latest()
    finally:
        trainer.close()
    assert str(info.value).splitlines()[0] == "the actor worker of rank 0 raised an exception:"
    assert "FloatingPointError: the loss is not finite" in info.value.summary
    assert latest is not None and latest.endswith("global_step_1") and is_complete(latest)


def test_sigterm_saves_the_last_step_and_the_run_resumes_on_its_curve(
    tmp_path: Path, tiny_model_dir, digits_data
) -> None:
    """SIGTERM to an inline `easyrl train` (one process, no Ray): exit 143 with the checkpoint of the last finished
    step; the relaunch resumes from it, and its steps equal an uninterrupted inline run's."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["trainer"].update(
        {"save_freq": -1, "save_on_interrupt": True, "max_steps": 4, "n_gpus_per_node": 1, "backend": "inline"}
    )
    cfg_path = write_config(tmp_path / "cfg.yaml", conf)
    log = tmp_path / "run" / "experiment_log.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "easyrl.cli", "train", cfg_path]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no step was logged in 300 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM after step" in stderr and "Ray initialized" not in stderr, stderr[-3000:]
    step = int((tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= step < 4 and (tmp_path / "run" / f"global_step_{step}" / "COMPLETE").exists()

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in log.read_text().splitlines()]
    full, _, _ = run(tmp_path / "full", tiny_model_dir, digits_data, {**ONE_WORKER, "trainer.backend": "inline"}, 4)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert _stable(rows) == _stable(full), "the resumed inline run left the uninterrupted curve"


LOSS_WITH_BREAKPOINT = """
from easyrl.algorithms import PpoParams, get_policy_loss, register_policy_loss

STOPPED = [False]

@register_policy_loss("ppo_with_breakpoint", params=PpoParams)
def ppo_with_breakpoint(**kwargs):
    if not STOPPED[0]:
        STOPPED[0] = True
        in_the_loss = 6 * 7
        breakpoint()
    return get_policy_loss("ppo")(**kwargs)
"""

REWARD_WITH_BREAKPOINT = """
import sys
sys.path.insert(0, {assets!r})
from digit_fraction_reward import compute_score as digits

REWARD_TYPE = "batch"
STOPPED = [False]

def compute_score(reward_inputs, **kwargs):
    if not STOPPED[0]:
        STOPPED[0] = True
        in_the_reward = 1000 + len(reward_inputs)
        breakpoint()
    return digits(reward_inputs)
"""


def test_breakpoint_in_a_loss_and_an_in_process_reward_stops_in_the_terminal(
    tmp_path: Path, tiny_model_dir, digits_data
) -> None:
    """Under inline, `breakpoint()` in a loss (a worker's code) and in a reward function run in the driver
    (`worker.reward.num_workers: 0`) opens pdb on the run's own stdin: the commands typed there are answered and
    `c` lets the run finish."""
    loss = tmp_path / "loss_bp.py"
    loss.write_text(LOSS_WITH_BREAKPOINT)
    reward = tmp_path / "reward_bp.py"
    reward.write_text(REWARD_WITH_BREAKPOINT.replace("{assets!r}", repr(str(REPO / "tests" / "assets"))))
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["user_modules"] = [str(loss)]
    conf["worker"]["actor"]["loss_type"] = "ppo_with_breakpoint"
    conf["worker"]["reward"].update({"reward_function": f"{reward}:compute_score", "num_workers": 0})
    conf["trainer"].update({"max_steps": 1, "n_gpus_per_node": 1, "backend": "inline"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("PYTHONBREAKPOINT", None)
    cmd = [sys.executable, "-m", "easyrl.cli", "train", write_config(tmp_path / "cfg.yaml", conf)]
    # the reward is scored before the update: its stop comes first
    typed = "p in_the_reward\nc\np in_the_loss\nc\n"
    done = subprocess.run(cmd, env=env, input=typed, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("(Pdb)") >= 2, done.stdout[-3000:]
    assert "(Pdb) 1008" in done.stdout and "(Pdb) 42" in done.stdout, done.stdout[-3000:]  # 4 prompts x n=2
