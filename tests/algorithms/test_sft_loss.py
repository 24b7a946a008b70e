"""The SFT objective (`easyrl.algorithms.sft`) against hand-computed numbers: masked tokens count for nothing, each
aggregation mode divides as documented, and validation reports per-token figures."""

from __future__ import annotations

import math

import pytest
import torch

from easyrl.algorithms.sft import nll_loss, token_accuracy, validation_metrics


LOG_PROB = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -9.0, -9.0]])  # (b=2, R=3)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # row 0 trains 2 tokens, row 1 one; the -4 and -9s are masked out


def test_token_mean_weighs_every_trained_token_alike() -> None:
    assert nll_loss(LOG_PROB, MASK).item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)


def test_seq_mean_token_mean_weighs_every_row_alike() -> None:
    # row 0: (1 + 2) / 2 = 1.5, row 1: 0.5; their mean
    assert nll_loss(LOG_PROB, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 0.5) / 2)


def test_seq_mean_token_sum_sums_each_row() -> None:
    assert nll_loss(LOG_PROB, MASK, "seq-mean-token-sum").item() == pytest.approx((3.0 + 0.5) / 2)


def test_nothing_trained_is_zero_not_nan_and_masked_inf_is_harmless() -> None:
    assert nll_loss(LOG_PROB, torch.zeros_like(MASK)).item() == 0.0
    with_inf = LOG_PROB.clone()
    with_inf[1, 2] = -math.inf  # padding may hold anything
    assert nll_loss(with_inf, MASK).item() == pytest.approx(3.5 / 3)


def test_the_gradient_is_minus_one_over_the_trained_tokens() -> None:
    lp = LOG_PROB.clone().requires_grad_(True)
    nll_loss(lp, MASK).backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -MASK.float() / 3)


def test_token_accuracy_counts_trained_tokens_only() -> None:
    top1 = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    assert token_accuracy(top1, MASK).item() == pytest.approx(2 / 3)


def test_validation_metrics_are_per_token() -> None:
    got = validation_metrics(nll_sum=6.0, top1_sum=3.0, tokens=4.0)
    assert got == {
        "val/loss": 1.5,
        "val/token_accuracy": 0.75,
        "val/perplexity": pytest.approx(math.exp(1.5)),
        "val/tokens": 4.0,
    }
    with pytest.raises(ValueError, match="no trained token"):
        validation_metrics(0.0, 0.0, 0.0)
