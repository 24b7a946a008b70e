"""Non-finite values never reach the optimizer: skipped, counted, and too many in a row stop the run."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_e2e import ray_session, run  # noqa: F401  (module-scoped Ray fixture)


pytestmark = pytest.mark.slow

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
from easyrl.algorithms import get_policy_loss, register_policy_loss

@register_policy_loss("ppo_nan")
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
