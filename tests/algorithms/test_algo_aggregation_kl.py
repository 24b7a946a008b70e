"""agg_loss, masked statistics and kl_penalty against hand-computed numbers."""

import math

import pytest
import torch

from easyrl.algorithms import (
    KL_PENALTY_KINDS,
    LOSS_AGG_MODES,
    agg_count,
    agg_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
)


L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 valid tokens
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (3/2 + 4/1) / 2
        ("seq-mean-token-sum-norm", 7.0 / 6.0),  # 7 / (B=2 * T=3)
    ],
)
def test_agg_loss_modes(mode: str, expected: float) -> None:
    assert agg_loss(loss_mat=L, loss_mask=M, loss_agg_mode=mode).item() == pytest.approx(expected)


def test_agg_modes_constant() -> None:
    assert set(LOSS_AGG_MODES) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }


def test_seq_mean_token_mean_skips_empty_sequences() -> None:
    loss = torch.tensor([[1.0, 2.0], [5.0, 5.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    # Row 1 has no valid token: (1.5 + 9) / 2 sequences, not / 3.
    assert agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode="seq-mean-token-mean").item() == pytest.approx(5.25)
    # seq-mean-token-sum counts every sequence: (3 + 0 + 9) / 3.
    assert agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode="seq-mean-token-sum").item() == pytest.approx(4.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_is_zero_not_nan(mode: str) -> None:
    loss = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]], requires_grad=True)
    out = agg_loss(loss_mat=loss, loss_mask=torch.zeros(2, 2), loss_agg_mode=mode)
    assert out.item() == 0.0
    out.backward()
    assert loss.grad is not None and torch.all(loss.grad == 0)


def test_inf_on_padding_is_ignored() -> None:
    loss = torch.tensor([[1.0, float("inf")], [3.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode="token-mean").item() == pytest.approx(2.0)


def test_bool_mask_accepted() -> None:
    assert agg_loss(loss_mat=L, loss_mask=M.bool(), loss_agg_mode="token-mean").item() == pytest.approx(7.0 / 3.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_parts_weighed_by_agg_count_add_up_to_the_whole(mode: str) -> None:
    """How the trainer weighs micro-batches and ranks: sum_p agg_loss(p) * agg_count(p) / agg_count(whole)."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    whole = agg_loss(loss, mask, mode)
    for cuts in ([1, 4], [2, 2, 1], [3, 2]):
        parts = zip(loss.split(cuts), mask.split(cuts))
        total = sum(agg_loss(lp, mp, mode) * agg_count(mp, mode) / agg_count(mask, mode) for lp, mp in parts)
        assert float(total) == pytest.approx(float(whole), rel=1e-6), (mode, cuts)
    # the plain mean of per-part aggregates is not the whole's (the bug of per-rank normalisation)
    means = [agg_loss(lp, mp, mode) for lp, mp in zip(loss.split([1, 4]), mask.split([1, 4]))]
    assert float(sum(means) / 2) != pytest.approx(float(whole), rel=1e-3)
    assert agg_count(mask, "token-mean") == 10.0
    assert agg_count(mask, "seq-mean-token-mean") == 4.0  # the all-masked row does not count
    assert agg_count(mask, "seq-mean-token-sum") == agg_count(mask, "seq-mean-token-sum-norm") == 5.0


def test_token_mean_gradient() -> None:
    loss = L.clone().requires_grad_(True)
    agg_loss(loss_mat=loss, loss_mask=M, loss_agg_mode="token-mean").backward()
    assert loss.grad is not None
    torch.testing.assert_close(loss.grad, M / 3.0)  # d(sum(L*M)/3)/dL = M/3


def test_unknown_mode_lists_modes() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(loss_mat=L, loss_mask=M, loss_agg_mode="token-sum")


def test_masked_mean_and_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    # mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1 -> [-1, 0, 1], padding 0.
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # A single valid value (or all equal) gives 0, never NaN.
    torch.testing.assert_close(masked_whiten(x, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), torch.zeros(1, 4))
    torch.testing.assert_close(masked_whiten(x, torch.zeros(1, 4)), torch.zeros(1, 4))


# d = log_prob - ref_log_prob = [0.5, -0.5]
LP = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-0.5, -0.5]])


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl", "k1"), [0.5, -0.5]),
        (("abs",), [0.5, 0.5]),
        (("mse", "k2"), [0.125, 0.125]),  # 0.5 * 0.25
        # exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.6065307 - 0.5 = 0.1065307; exp(0.5) - 1.5 = 1.6487213 - 1.5 = 0.1487213
        (("low_var_kl", "k3"), [0.1065307, 0.1487213]),
    ],
)
def test_kl_penalty_kinds(kinds: tuple[str, ...], expected: list[float]) -> None:
    for kind in kinds:
        out = kl_penalty(log_prob=LP, ref_log_prob=REF, kl_penalty=kind)
        assert out.shape == (1, 2)
        torch.testing.assert_close(out, torch.tensor([expected]), atol=1e-6, rtol=0)


def test_low_var_kl_is_clamped_and_finite() -> None:
    lp = torch.tensor([[-30.0, 30.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.0, -1.0]])
    out = kl_penalty(log_prob=lp, ref_log_prob=ref, kl_penalty="low_var_kl")
    # d = -30: exp(30) + ... -> 10; d = 30: exp(-30) + 29 -> 10; d = 0: 1 - 0 - 1 = 0.
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0, 0.0]]))
    out.sum().backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def test_kl_full_and_unknown() -> None:
    with pytest.raises(NotImplementedError, match="logits"):
        kl_penalty(log_prob=LP, ref_log_prob=REF, kl_penalty="full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(log_prob=LP, ref_log_prob=REF, kl_penalty="k4")
    assert set(KL_PENALTY_KINDS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert math.isclose(kl_penalty(log_prob=LP, ref_log_prob=LP).abs().sum().item(), 0.0)
