"""Non-finite values never reach the optimizer: skipped, counted, and too many in a row stop the run; a rank that
raises stops every rank, and the last checkpoint resumes."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

NAN_ADVANTAGE_AT_STEP_2 = """
import torch
from easyrl.algorithms import get_advantage_estimator, register_advantage_estimator

CALLS = [0]

@register_advantage_estimator("grpo_nan_at_step_2")
def grpo_nan_at_step_2(token_level_rewards, response_mask, index, **kwargs):
    CALLS[0] += 1
    adv, ret = get_advantage_estimator("grpo")(token_level_rewards=token_level_rewards, response_mask=response_mask,
                                              index=index, **kwargs)
    if CALLS[0] == 2:
        adv = adv + float("nan")
    return adv, ret
"""

NAN_LOSS = """
from easyrl.algorithms import PpoParams, get_policy_loss, register_policy_loss

@register_policy_loss("ppo_nan", params=PpoParams)  # wraps ppo: takes its knobs
def ppo_nan(**kwargs):
    loss, metrics = get_policy_loss("ppo")(**kwargs)
    return loss * float("nan"), metrics
"""


def test_nan_advantage_skips_that_update_only(tmp_path, tiny_model_dir, digits_data) -> None:
    plugin = tmp_path / "nan_adv.py"
    plugin.write_text(NAN_ADVANTAGE_AT_STEP_2)
    edits = {
        "algorithm.adv_estimator": "grpo_nan_at_step_2",
        "algorithm.user_modules": [str(plugin)],
        "worker.actor.max_consecutive_skips": 3,
    }
    weights: list[dict[str, torch.Tensor]] = []
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=3, weights_each_step=weights)
    assert [r["actor/skipped_updates"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["training/nonfinite/advantages"] == 1.0
    assert [r["actor/consecutive_skips"] for r in rows] == [0.0, 1.0, 0.0]
    # weights[k] is the policy after step k (weights[0]: before training).
    assert all(torch.equal(weights[1][n], weights[2][n]) for n in weights[1]), "step 2 changed parameters"
    assert any(not torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert any(not torch.equal(weights[2][n], weights[3][n]) for n in weights[2])


def test_nan_loss_stops_after_k_consecutive_skips(tmp_path, tiny_model_dir, digits_data) -> None:
    from easyrl.trainer.trainer import TrainingError

    plugin = tmp_path / "nan_loss.py"
    plugin.write_text(NAN_LOSS)
    edits = {
        "worker.actor.loss_type": "ppo_nan",
        "algorithm.user_modules": [str(plugin)],
        "worker.actor.max_consecutive_skips": 2,
    }
    weights: list[dict[str, torch.Tensor]] = []
    with pytest.raises(TrainingError, match=r"step 2: 2 consecutive actor updates skipped .*actor loss"):
        run(tmp_path, tiny_model_dir, digits_data, edits, steps=4, weights_each_step=weights)
    assert len(weights) == 2  # before training, after step 1; the run stopped during step 2
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0]), "a NaN loss reached the optimizer"


LOSS_FAILS_ON_RANK_1_AT_STEP_2 = """
import time
import torch.distributed as dist
from easyrl.algorithms import PpoParams, get_policy_loss, register_policy_loss

CALLS = [0]

@register_policy_loss("ppo_fails_on_rank_1", params=PpoParams)
def ppo_fails_on_rank_1(**kwargs):
    CALLS[0] += 1  # two mini-batches per step on each rank (base config): call 3 is step 2's first
    if dist.get_rank() == 1 and CALLS[0] == 3:
        with open({stamp!r}, "w") as f:
            f.write(repr(time.time()))
        raise FloatingPointError("loss of rank 1's shard is not finite")
    return get_policy_loss("ppo")(**kwargs)
"""


def test_rank_1_raising_in_an_update_stops_every_rank(tmp_path, tiny_model_dir, digits_data) -> None:
    """Step 2's update raises on rank 1 while rank 0 goes on into the backward's reduce-scatter and waits there
    for rank 1. The run stops within seconds (not gloo's 30-minute timeout) naming rank 1 and its error, rank 0 is
    stopped, and step 1's checkpoint is intact and resumes."""
    import ray

    from easyrl.checkpoint import is_complete, verify_checkpoint
    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import WorkerError
    from easyrl.trainer.trainer import Trainer
    from tests.conftest import base_config, write_config

    stamp = tmp_path / "fault_time"
    plugin = tmp_path / "fails_on_rank_1.py"
    plugin.write_text(LOSS_FAILS_ON_RANK_1_AT_STEP_2.replace("{stamp!r}", repr(str(stamp))))
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["user_modules"] = [str(plugin)]
    conf["worker"]["actor"]["loss_type"] = "ppo_fails_on_rank_1"
    conf["trainer"].update({"max_steps": 3, "save_freq": 1})
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        rank0 = trainer.actor._actors[0]
        with pytest.raises(WorkerError) as info:
            trainer.fit()
        waited = time.time() - float(stamp.read_text())
        logging.getLogger(__name__).info("rank 1's error reached the driver %.2f s after it was raised", waited)
        assert waited < 60, f"the driver saw rank 1's error {waited:.1f} s after it was raised"
        assert info.value.role == "actor" and info.value.rank == 1, str(info.value)
        assert "FloatingPointError: loss of rank 1's shard is not finite" in str(info.value)
        assert "rank(s) [0] were still running 'update_actor'" in str(info.value)
        with pytest.raises(ray.exceptions.RayActorError):  # rank 0 is not left waiting in the collective
            ray.get(rank0.__ray_ready__.remote(), timeout=30)
        latest = trainer.ckpt.latest()
    finally:
        trainer.close()
    assert latest is not None and latest.endswith("global_step_1") and is_complete(latest)
    verify_checkpoint(latest)

    conf["worker"]["actor"]["loss_type"] = "ppo"  # the re-launch, with the fault fixed
    conf["trainer"]["max_steps"] = 2
    resumed = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        assert resumed.global_step == 1
        resumed.fit()
        assert resumed.global_step == 2
    finally:
        resumed.close()
