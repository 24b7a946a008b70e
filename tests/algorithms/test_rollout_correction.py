"""Each rollout correction against numbers worked out by hand on small batches (easyrl/algorithms/rollout_correction.py).

The batches hold the engine's log-probs at 0 and the old ones at log r, so each token's ratio pi_old / pi_rollout is
the r written in the test. No ratio sits on a threshold: float32 log(2) is not Python's log(2).
"""

from __future__ import annotations

import math

import pytest
import torch

from easyrl.algorithms.rollout_correction import (
    SAFETY_BOUND,
    _quantiles,
    correct_rollout,
    importance_weights,
    log_ratios,
    mismatch_metrics,
    rejected_by_ratio,
    vetoed,
)
from easyrl.config import RolloutCorrectionConfig


def _rows(*ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, loss_mask) (B, T) for rows of ratios, right-padded; padding holds an old log-prob of -inf, as a
    position off the mask may."""
    width = max(len(r) for r in ratios)
    old = torch.full((len(ratios), width), -math.inf)
    mask = torch.zeros(len(ratios), width, dtype=torch.long)
    for i, row in enumerate(ratios):
        old[i, : len(row)] = torch.tensor([math.log(r) for r in row])
        mask[i, : len(row)] = 1
    return old, torch.zeros_like(old), mask


def _log_ratio(*ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old, rollout, mask = _rows(*ratios)
    valid = mask.bool()
    return log_ratios(old, rollout, valid), valid


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


ROWS = ([0.5, 1.0, 4.0], [1.5, 0.8])  # 5 trained tokens; row products 2.0 (avoided below) and 1.2


def test_log_ratios_are_zero_off_the_mask_even_where_a_log_prob_is_infinite() -> None:
    lr, _ = _log_ratio(*ROWS)
    assert torch.isfinite(lr).all()
    _close(lr, [[math.log(0.5), 0.0, math.log(4.0)], [math.log(1.5), math.log(0.8), 0.0]])


def test_token_tis_clamps_each_token_weight_at_the_threshold() -> None:
    lr, valid = _log_ratio(*ROWS)
    weights, m = importance_weights(lr, valid, "token", upper=2.0)
    _close(weights, [[0.5, 1.0, 2.0], [1.5, 0.8, 0.0]])  # 4 -> 2; padding 0
    assert m["rollout_is_clamped_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_is_masked_fraction"] == 0.0


def test_sequence_tis_puts_the_truncated_product_on_every_token() -> None:
    lr, valid = _log_ratio([0.5, 1.5, 4.0], [1.2, 0.5])  # products 3.0 and 0.6
    weights, m = importance_weights(lr, valid, "sequence", upper=2.0)
    _close(weights, [[2.0, 2.0, 2.0], [0.6, 0.6, 0.0]])
    assert m["rollout_is_clamped_fraction"] == pytest.approx(3 / 5)  # every token of the clamped sequence


def test_icepop_zeroes_weights_outside_the_band_instead_of_clamping() -> None:
    lr, valid = _log_ratio(*ROWS)
    weights, m = importance_weights(lr, valid, "token", upper=2.0, lower=0.6)
    _close(weights, [[0.0, 1.0, 0.0], [1.5, 0.8, 0.0]])  # 0.5 below, 4 above: zeroed, not clamped
    assert m["rollout_is_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_is_clamped_fraction"] == 0.0
    lr, valid = _log_ratio([0.5, 1.5, 4.0], [1.2, 0.5])  # sequence products 3.0 (out) and 0.6 (in)
    weights, _ = importance_weights(lr, valid, "sequence", upper=2.0, lower=0.5)
    _close(weights, [[0.0, 0.0, 0.0], [0.6, 0.6, 0.0]])


def test_batch_normalize_divides_by_the_token_mean_or_the_sequence_mean() -> None:
    lr, valid = _log_ratio(*ROWS)
    weights, m = importance_weights(lr, valid, "token", upper=2.0, batch_normalize=True)
    mean = (0.5 + 1.0 + 2.0 + 1.5 + 0.8) / 5  # 1.16, over the trained tokens
    _close(weights, [[0.5 / mean, 1.0 / mean, 2.0 / mean], [1.5 / mean, 0.8 / mean, 0.0]])
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert m["rollout_is_mean"] == pytest.approx(1.0)
    lr, valid = _log_ratio([0.5, 1.5, 4.0], [1.2, 0.5])  # sequence weights 2.0 (3 tokens) and 0.6 (2 tokens)
    weights, m = importance_weights(lr, valid, "sequence", upper=2.0, batch_normalize=True)
    mean = (2.0 + 0.6) / 2  # 1.3 over sequences, not 7.2 / 5 over tokens
    _close(weights, [[2.0 / mean] * 3, [0.6 / mean, 0.6 / mean, 0.0]])
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mean)


def test_token_rejection_drops_tokens_outside_the_band_with_lower_defaulting_to_one_over_upper() -> None:
    lr, valid = _log_ratio([0.4, 1.0, 4.0], [1.5, 0.8])
    rejected, m = rejected_by_ratio(lr, valid, "token", upper=2.0)  # band [0.5, 2]
    assert rejected.tolist() == [[True, False, True], [False, False, False]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    rejected, _ = rejected_by_ratio(lr, valid, "token", upper=2.0, lower=0.3)  # explicit lower keeps 0.4
    assert rejected.tolist() == [[False, False, True], [False, False, False]]


def test_sequence_rejection_judges_the_product_of_the_ratios() -> None:
    lr, valid = _log_ratio([0.4, 1.0, 4.0], [3.0, 1.0])  # products 1.6 (in [0.5, 2]) and 3.0 (out)
    rejected, m = rejected_by_ratio(lr, valid, "sequence", upper=2.0)
    assert rejected.tolist() == [[False, False, False], [True, True, False]]  # padding is never "rejected"
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_geometric_rejection_judges_the_mean_log_ratio_with_both_edges() -> None:
    lr, valid = _log_ratio([2.0, 8.0], [1.1, 0.9])  # geometric means 4 and sqrt(0.99) = 0.99499
    rejected, _ = rejected_by_ratio(lr, valid, "geometric", upper=1.1)  # band [0.909, 1.1]
    assert rejected.tolist() == [[True, True], [False, False]]
    rejected, m = rejected_by_ratio(lr, valid, "geometric", upper=1.1, lower=0.999)  # 0.995 now below
    assert rejected.tolist() == [[True, True], [True, True]]
    assert m["rollout_rs_seq_masked_fraction"] == 1.0


def test_veto_rejects_a_whole_sequence_for_one_catastrophic_token_even_past_the_safety_clamp() -> None:
    lr, valid = _log_ratio([1.0, 1e-5, 1.0], [0.5, 2.0])
    rejected, m = vetoed(lr, valid, threshold=1e-4)
    assert rejected.tolist() == [[True, True, True], [False, False, False]]
    assert m["rollout_is_veto_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    # e^-30 and e^-26 both clamp to e^-20: judged on the log-ratio, only the first is below e^-28.
    lr, valid = _log_ratio([math.exp(-30)], [math.exp(-26)])
    rejected, _ = vetoed(lr, valid, threshold=math.exp(-28))
    assert rejected.tolist() == [[True], [False]]


def test_safety_clamp_keeps_weights_finite_and_bands_judged_on_the_log_ratio() -> None:
    lr = torch.tensor([[25.0, 1000.0, -1000.0]])
    valid = torch.ones_like(lr, dtype=torch.bool)
    # An upper bound past e^20 truncates nothing: the weight is exp(20), not exp(25) nor inf.
    weights, _ = importance_weights(lr, valid, "token", upper=1e12)
    _close(weights, [[math.exp(SAFETY_BOUND), math.exp(SAFETY_BOUND), math.exp(-SAFETY_BOUND)]])
    assert torch.isfinite(weights).all()
    # A sequence sum of 1000 + 25 - 1000 = 25: outside an IcePop band up to 1e10 (log 23.03), though its clamped
    # ratio exp(20) = 4.9e8 lies inside it.
    weights, m = importance_weights(lr, valid, "sequence", upper=1e10, lower=0.5)
    assert weights.eq(0).all() and m["rollout_is_masked_fraction"] == 1.0
    weights, _ = importance_weights(lr, valid, "sequence", upper=2.0)
    _close(weights, [[2.0, 2.0, 2.0]])


def test_mismatch_kl_and_weight_statistics_on_a_hand_example() -> None:
    lr, valid = _log_ratio([0.5, 2.0])
    m = mismatch_metrics(lr, valid)
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)  # mean(-log r) = (log 2 - log 2) / 2
    assert m["k3_kl"] == pytest.approx(0.25)  # ((0.5 - 1 + log 2) + (2 - 1 - log 2)) / 2
    lr, valid = _log_ratio([0.5, 1.0], [1.5, 1.9])
    _, m = importance_weights(lr, valid, "token", upper=3.0)  # weights 0.5, 1, 1.5, 1.9: none clamped
    assert m["rollout_is_mean"] == pytest.approx(4.9 / 4)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt((0.25 + 1 + 2.25 + 3.61) / 4 - (4.9 / 4) ** 2))
    assert (m["rollout_is_min"], m["rollout_is_max"]) == pytest.approx((0.5, 1.9))
    # Linear interpolation in the sorted weights: positions 1.5, 2.7, 2.97 of 0..3.
    assert m["rollout_is_p50"] == pytest.approx(1.25)
    assert m["rollout_is_p90"] == pytest.approx(1.5 + 0.7 * 0.4)
    assert m["rollout_is_p99"] == pytest.approx(1.5 + 0.97 * 0.4)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(4.9**2 / (4 * 7.11))


def test_quantiles_match_torch_quantile() -> None:
    values = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    qs = (0.0, 0.5, 0.9, 0.99, 1.0)
    assert _quantiles(values, qs) == pytest.approx(torch.quantile(values.double(), torch.tensor(qs).double()).tolist())


def test_correct_rollout_combines_weights_rejection_and_veto_over_the_same_ratios() -> None:
    old, rollout, mask = _rows([1.5, 0.8, 1.2], [3.0, 1.0], [1.0, 1e-6])
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=2.0,
        rollout_token_veto_threshold=1e-4,
    )  # fmt: skip
    out = correct_rollout(old, rollout, mask, cfg)
    # Row 0 (product 1.44) stays; row 1 (product 3) is rejected; row 2 is vetoed (and its product 1e-6 rejected).
    assert out.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert out.loss_mask.dtype == mask.dtype
    assert out.weights is not None  # computed before rejection, over every trained token
    _close(out.weights, [[1.5, 0.8, 1.2], [2.0, 1.0, 0.0], [1.0, 1e-6, 0.0]])
    assert out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert out.metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 3)
    assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_p99"} <= set(out.metrics)
    assert all(k.startswith("rollout_corr/") for k in out.metrics)


def test_rejection_alone_leaves_no_weights_and_nothing_on_means_nothing_changes() -> None:
    old, rollout, mask = _rows([0.6, 1.0, 4.0], [1.5, 0.4])
    out = correct_rollout(old, rollout, mask, RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0))
    assert out.weights is None
    assert out.loss_mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    out = correct_rollout(old, rollout, mask, RolloutCorrectionConfig())
    assert out.weights is None and torch.equal(out.loss_mask, mask)
    assert set(out.metrics) == {"rollout_corr/kl", "rollout_corr/k3_kl"}
