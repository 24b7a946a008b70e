"""Pure per-step functions of the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config import RolloutCorrectionConfig
from easyrl.trainer.step_math import (
    OldPass,
    apply_rollout_correction,
    logprob_consistency,
    mini_batch_major_order,
    old_pass_rows,
    policy_version_metrics,
    pool_reward_metrics,
    resumed_policy_version,
    sampled_validation_metrics,
)


def test_pooled_reward_metrics_weigh_means_and_sum_counters() -> None:
    first = {"reward/overall": 1.0, "reward/accuracy": 0.5, "reward/errors": 1.0, "reward/timeouts": 0.0}
    second = {"reward/overall": 0.0, "reward/errors": 2.0, "reward/timeouts": 1.0, "reward/format": 1.0}
    pooled = pool_reward_metrics([(first, 6), (second, 2)])
    assert pooled["reward/overall"] == pytest.approx(6 / 8)  # as if the 8 samples were scored at once
    assert pooled["reward/accuracy"] == 0.5  # only the samples that report it
    assert pooled["reward/format"] == 1.0
    assert pooled["reward/errors"] == 3.0 and pooled["reward/timeouts"] == 1.0
    assert pool_reward_metrics([]) == {}
    assert pool_reward_metrics([(first, 4)]) == first


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_mini_batch_major_order_gives_every_rank_a_share_of_each_global_mini_batch(dp: int) -> None:
    rows, mini = 24, 8
    order = mini_batch_major_order(rows, mini, dp)
    assert sorted(order) == list(range(rows))
    chunks = [order[r * rows // dp : (r + 1) * rows // dp] for r in range(dp)]  # what DP_SPLIT hands rank r
    for k in range(rows // mini):  # the worker's k-th mini-batch of mini / dp rows, over all ranks: global k
        step = [i for chunk in chunks for i in chunk[k * mini // dp : (k + 1) * mini // dp]]
        assert sorted(step) == list(range(k * mini, (k + 1) * mini))
    if dp == 1:
        assert order == list(range(rows))
    with pytest.raises(ValueError, match="global_batch_size"):
        mini_batch_major_order(rows, 5, dp)


def test_old_log_prob_pass_is_skipped_only_for_one_epoch_over_one_mini_batch_with_nothing_reading_it() -> None:
    base = {
        "ppo_epochs": 1,
        "mini_batches": 1,
        "kl_in_reward": False,
        "correction": False,
        "adaptive_entropy": False,
        "bypass": False,
    }
    assert old_pass_rows(**base) is OldPass.NONE  # the update's forward runs the rollout policy's weights
    for key, value in (
        ("ppo_epochs", 2),  # the second epoch runs moved weights
        ("mini_batches", 2),  # so does the second mini-batch
        ("kl_in_reward", True),  # the reward reads KL(old || ref) before the update
        ("correction", True),  # importance weights, rejection and veto compare old with rollout
        ("adaptive_entropy", True),  # the controller reads the pass's entropy before the update
        ("distill", True),  # the student's log-probs meet the teacher's in the advantages
    ):
        assert old_pass_rows(**{**base, key: value}) is OldPass.ALL_ROWS, key
    # Bypass mode: the engine's log-probs are the old ones, whatever the epochs, mini-batches or KL in the reward.
    reusing = {**base, "ppo_epochs": 2, "mini_batches": 2, "kl_in_reward": True}
    assert old_pass_rows(**{**reusing, "bypass": True}) is OldPass.NONE


def test_mini_batch_1_takes_the_first_forward_only_when_the_pass_is_there_for_later_optimizer_steps() -> None:
    """With `reuse_first_forward` the pass leaves mini-batch 1 out exactly when it runs only because a later
    optimizer step sees moved weights; a reader before the update still needs every row, and one epoch over one
    mini-batch still needs none."""
    base = {"kl_in_reward": False, "correction": False, "adaptive_entropy": False, "bypass": False}
    on = {**base, "reuse_first_forward": True}
    for epochs, minis in ((1, 2), (2, 1), (3, 4)):
        assert old_pass_rows(**on, ppo_epochs=epochs, mini_batches=minis) is OldPass.AFTER_FIRST_MINI_BATCH
        assert old_pass_rows(**base, ppo_epochs=epochs, mini_batches=minis) is OldPass.ALL_ROWS  # off by default
    assert old_pass_rows(**on, ppo_epochs=1, mini_batches=1) is OldPass.NONE
    for reader in ("kl_in_reward", "correction", "adaptive_entropy", "distill"):
        assert old_pass_rows(**{**on, reader: True}, ppo_epochs=1, mini_batches=2) is OldPass.ALL_ROWS, reader
    assert old_pass_rows(**{**on, "bypass": True}, ppo_epochs=2, mini_batches=2) is OldPass.NONE
    assert [rows.before_update for rows in OldPass] == [True, False, False]


def test_logprob_consistency_scores_the_trained_tokens_of_rows_with_engine_log_probs() -> None:
    """Row 0: 3 trained tokens, one off by ln(1.1) and one by ln(1.2); row 1 has no engine log-probs (vLLM sampled
    other prompts' log-probs), row 2 has them but one trained token only (tool output after it), equal."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-0.5, -7.0, -7.0]])
    rollout = old + torch.tensor([[math.log(1.1), 0.0, -math.log(1.2)], [5.0, 5.0, 5.0], [0.0, 3.0, 3.0]])
    batch = Batch(
        {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "loss_mask": torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]]),
            "rollout_logprob_mask": torch.tensor([True, False, True]),
        }
    )
    metrics = logprob_consistency(batch)
    assert metrics["rollout/token_prob_error"] == pytest.approx((1.1 + 1.0 + 1.2 + 1.0) / 4, rel=1e-6)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx((math.log(1.1) + math.log(1.2)) / 4, rel=1e-6)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(math.log(1.2), rel=1e-6)
    # Through the correction stage with nothing on: the figures, and no edit of the batch.
    assert apply_rollout_correction(batch, RolloutCorrectionConfig()) == metrics
    batch.set(rollout_logprob_mask=torch.tensor([False, False, False]))
    assert logprob_consistency(batch) == {}  # no token scored: no figure (not a perfect 1.0)


def test_sampled_validation_metrics_per_prompt_mean_best_and_pass() -> None:
    # Two prompts, n=3: prompt 0 solved once (accuracy 1), prompt 1 never (its best overall is 0.9, accuracy 0.8).
    scores = [
        {"overall": 0.2, "accuracy": 0.0},
        {"overall": 1.0, "accuracy": 1.0},
        {"overall": 0.3, "accuracy": 0.2},
        {"overall": 0.9, "accuracy": 0.8},
        {"overall": 0.5, "accuracy": 0.4},
        {"overall": 0.1, "accuracy": 0.0},
    ]
    got = sampled_validation_metrics(scores, 3)
    assert got == pytest.approx(
        {"val/reward/mean@3": (1.5 / 3 + 1.5 / 3) / 2, "val/reward/best@3": 0.95, "val/pass@3": 0.5}
    )
    # Without an accuracy sub-score a sample passes on a full overall score; n=1 is greedy validation's case.
    assert sampled_validation_metrics([{"overall": 1.0}, {"overall": 0.99}], 1) == {
        "val/reward/mean@1": pytest.approx(0.995),
        "val/reward/best@1": pytest.approx(0.995),
        "val/pass@1": 0.5,
    }
    with pytest.raises(ValueError, match="groups of n=4"):
        sampled_validation_metrics(scores, 4)


def test_policy_version_metrics_name_the_oldest_and_newest_sampler() -> None:
    batch = Batch({"policy_version": torch.tensor([3, 5, 4, 5], dtype=torch.int64)})
    assert policy_version_metrics(batch) == {"rollout/policy_version_min": 3.0, "rollout/policy_version_max": 5.0}
    one = Batch({"policy_version": torch.zeros(2, dtype=torch.int64)})
    assert policy_version_metrics(one) == {"rollout/policy_version_min": 0.0, "rollout/policy_version_max": 0.0}


def test_a_resumed_run_counts_one_update_per_step_past_the_critic_warmup() -> None:
    assert resumed_policy_version(global_step=4, critic_warmup=0) == 4
    assert resumed_policy_version(global_step=4, critic_warmup=1) == 3
    assert resumed_policy_version(global_step=1, critic_warmup=3) == 0
