"""The engine-vs-trainer figures (easyrl/algorithms/logprob_gap.py) against numbers worked out by hand: NeMo-RL's
`token_mult_prob_error` (the mean of exp|d|) beside the mean and max of |d|, over the scored tokens only; their
parts add up across splits of a batch to the whole batch's figures."""

from __future__ import annotations

import math

import pytest
import torch

from easyrl.algorithms.logprob_gap import (
    DIFF_MAX,
    DIFF_MEAN,
    TOKEN_PROB_ERROR,
    exact_metrics,
    logprob_gap,
    scored_tokens,
)


LN_1_1 = math.log(1.1)


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(engine, trainer, loss_mask, rollout_logprob_mask): row 0 has 4 trained tokens, two of them off by ln(1.1)
    (one each way); row 1 has 2 trained tokens off by ln(2) but no engine log-probs (its engine zeros); both rows'
    padding holds a trainer log-prob of -inf and NaN."""
    trainer = torch.tensor(
        [[-1.0, -2.0, -0.5, -3.0, -math.inf], [-1.0, -1.0, math.nan, -math.inf, -math.inf]], dtype=torch.float64
    )
    engine = torch.tensor(
        [[-1.0 + LN_1_1, -2.0, -0.5 - LN_1_1, -3.0, 0.0], [-1.0 + math.log(2.0), -1.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    loss_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    return engine, trainer, loss_mask, torch.tensor([True, False])


def test_token_prob_error_is_the_mean_of_exp_abs_diff_over_the_scored_tokens() -> None:
    engine, trainer, loss_mask, sampled = _rows()
    metrics = logprob_gap(engine, trainer, scored_tokens(loss_mask, sampled)).metrics()
    assert metrics[TOKEN_PROB_ERROR] == pytest.approx((1.1 + 1.0 + 1.1 + 1.0) / 4, rel=1e-12)  # 1.05: the gate
    assert metrics[DIFF_MEAN] == pytest.approx(2 * LN_1_1 / 4, rel=1e-12)
    assert metrics[DIFF_MAX] == pytest.approx(LN_1_1, rel=1e-12)
    # Every token off by ln(1.1): exactly 1.1. Identical log-probs: exactly 1.
    only_off = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert logprob_gap(engine, trainer, only_off).metrics()[TOKEN_PROB_ERROR] == pytest.approx(1.1, rel=1e-12)
    same = logprob_gap(trainer[:, :2], trainer[:, :2], scored_tokens(loss_mask[:, :2], None))
    assert same.metrics() == {TOKEN_PROB_ERROR: 1.0, DIFF_MEAN: 0.0, DIFF_MAX: 0.0}


def test_rows_without_engine_log_probs_count_only_when_no_mask_says_so() -> None:
    engine, trainer, loss_mask, _ = _rows()
    # No (B,) mask (the HF engine gives every row): row 1's two tokens count too, one off by ln(2).
    metrics = logprob_gap(engine, trainer, scored_tokens(loss_mask, None)).metrics()
    assert metrics[TOKEN_PROB_ERROR] == pytest.approx((4.2 + 2.0 + 1.0) / 6, rel=1e-12)
    assert metrics[DIFF_MAX] == pytest.approx(math.log(2.0), rel=1e-12)


def test_no_scored_token_gives_no_figure_rather_than_zero() -> None:
    engine, trainer, loss_mask, _ = _rows()
    gap = logprob_gap(engine, trainer, scored_tokens(loss_mask, torch.tensor([False, False])))
    assert gap.metrics() == {}
    assert float(gap.tokens) == 0.0 and float(gap.abs_diff_max) == -math.inf


def test_parts_of_a_batch_add_up_to_the_whole_batchs_figures() -> None:
    """Summing numerators and denominators (and taking the max) over row splits gives the whole batch's figures;
    averaging the parts' means would not (the parts hold different numbers of scored tokens)."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    engine = trainer + 0.2 * torch.randn(6, 7, generator=g, dtype=torch.float64)
    scored = torch.rand(6, 7, generator=g) < torch.linspace(0.1, 0.9, 6).unsqueeze(1)  # unequal rows
    scored[:, 0] = True  # every part scores something
    whole = logprob_gap(engine, trainer, scored).metrics()
    parts = [
        logprob_gap(engine[rows], trainer[rows], scored[rows]) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    ratios = {
        key: (sum(float(p.ratios()[key][0]) for p in parts), sum(float(p.ratios()[key][1]) for p in parts))
        for key in (DIFF_MEAN, TOKEN_PROB_ERROR)
    }
    summed = exact_metrics(ratios, {DIFF_MAX: max(float(p.abs_diff_max) for p in parts)})
    assert summed == pytest.approx(whole, rel=1e-12)
    mean_of_means = sum(p.metrics()[TOKEN_PROB_ERROR] for p in parts) / len(parts)
    assert abs(mean_of_means - whole[TOKEN_PROB_ERROR]) > 1e-4  # what a per-part average would have logged


def test_exact_metrics_leaves_out_figures_over_nothing() -> None:
    got = exact_metrics({"a": (3.0, 2.0), "b": (0.0, 0.0)}, {"m": -math.inf, "n": 0.0})
    assert got == {"a": 1.5, "n": 0.0}


def test_with_asynchronous_rollouts_only_the_tokens_the_compared_weights_sampled_are_scored() -> None:
    """Policy version 1 is compared: a token version 0 sampled is off by how far the policy moved since, not by the
    numerics, and stays out; a row of version 1 and the version-1 part of a resumed row count."""
    loss_mask = torch.ones(2, 3)
    versions = torch.tensor([[0, 0, 1], [1, 1, 1]])
    engine = torch.zeros(2, 3)
    trainer = torch.tensor([[math.log(3.0), math.log(3.0), math.log(1.1)], [math.log(1.1)] * 3])
    scored = scored_tokens(loss_mask, None, versions, 1)
    assert scored.tolist() == [[False, False, True], [True, True, True]]
    assert logprob_gap(engine, trainer, scored).metrics()["rollout/token_prob_error"] == pytest.approx(1.1)
    assert scored_tokens(loss_mask, None, versions, None).all()  # no version given: every token (synchronous)
