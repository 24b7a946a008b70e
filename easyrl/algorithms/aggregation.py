"""Reduce a per-token loss matrix to a scalar, and masked statistics shared by the other modules."""

from __future__ import annotations

import torch

from easyrl.config.names import LOSS_AGG_MODES


__all__ = ["LOSS_AGG_MODES", "agg_count", "agg_loss", "masked_mean", "masked_whiten"]


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with padded positions forced to exactly 0.

    Padding may hold inf/NaN (e.g. log-probs of pad tokens); ``inf * 0`` is NaN, so select instead of multiply.
    """
    mask = mask.to(values.dtype)
    return torch.where(mask != 0, values * mask, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is nonzero; 0 when nothing is valid.

    Args:
        values: (B, T) (any shape broadcastable with ``mask``).
        mask: (B, T), 1 for valid positions.

    Returns:
        Scalar tensor.
    """
    total = _masked(values, mask).sum()
    count = mask.to(values.dtype).sum()
    # where() computes both branches: the clamp keeps the unused one from being 0 / 0.
    return torch.where(count > 0, total / count.clamp(min=1e-8), torch.zeros_like(total))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``values`` over the valid positions: ``(x - mean) * rsqrt(var + eps)``, zero on padding.

    ``mean`` is the masked mean and ``var`` the unbiased (n - 1) masked variance over *all* valid positions of the
    batch. With fewer than two valid positions the variance is taken as 0 (every value equals the mean then, so
    the result is 0 rather than NaN).

    Args:
        values: (B, T).
        mask: (B, T), 1 for valid positions.
        eps: added to the variance before the reciprocal square root.

    Returns:
        (B, T) whitened values, 0 where ``mask`` is 0.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum()
    mean = masked_mean(values, mask)
    centered = _masked(values - mean, mask)
    var = torch.where(count > 1, (centered**2).sum() / (count - 1).clamp(min=1.0), torch.zeros_like(count))
    return centered * torch.rsqrt(var + eps)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    Modes (L = ``loss_mat``, M = ``loss_mask``, both (B, T)):

    * ``token-mean``: ``sum(L*M) / sum(M)`` -- every valid token weighs the same (DAPO).
    * ``seq-mean-token-sum``: mean over the B sequences of ``sum_t L*M``.
    * ``seq-mean-token-mean``: mean, over sequences with at least one valid token, of ``sum_t L*M / sum_t M``
      (the original GRPO).
    * ``seq-mean-token-sum-norm``: ``sum(L*M) / (B * T)`` with T = ``loss_mask.shape[-1]``, a constant
      normaliser independent of response lengths (Dr.GRPO).

    Every mode is a sum over the rows divided by ``agg_count(M, mode)``, so the aggregate of a batch split in parts
    is ``sum_p agg_loss(part p) * agg_count(part p) / agg_count(whole)``: how the trainer weighs micro-batches and
    ranks (`easyrl.workers.forward_backward.optimize`). An all-masked input returns 0 (never NaN), so an empty
    micro-batch contributes nothing.

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: (B, T) 1 for tokens that count.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns:
        Scalar tensor.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    masked = _masked(loss_mat, loss_mask)
    mask_f = loss_mask.to(loss_mat.dtype)
    zero = masked.sum() * 0.0  # keeps the graph (and device/dtype) for the degenerate cases

    if loss_agg_mode == "token-mean":
        total = masked.sum()
        count = mask_f.sum()
        # where() evaluates both branches: the clamp keeps the unused one finite, so no NaN enters the backward.
        return torch.where(count > 0, total / count.clamp(min=1e-8), zero)

    if loss_mat.dim() == 0 or loss_mat.shape[0] == 0:  # no rows: .mean() over nothing would be NaN
        return zero
    seq_sums = masked.sum(dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_counts = mask_f.sum(dim=-1)  # (B,)
        has_tokens = seq_counts > 0
        seq_means = torch.where(has_tokens, seq_sums / seq_counts.clamp(min=1e-8), torch.zeros_like(seq_sums))
        n_seqs = has_tokens.to(loss_mat.dtype).sum()
        return torch.where(n_seqs > 0, seq_means.sum() / n_seqs.clamp(min=1.0), zero)
    # seq-mean-token-sum-norm
    return masked.sum() / (loss_mask.shape[0] * loss_mask.shape[-1])


def agg_count(loss_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """What `agg_loss` divides its sum over the rows by, for a mask (B, T): valid tokens (``token-mean``), rows
    with at least one valid token (``seq-mean-token-mean``), or rows (the other two modes; ``seq-mean-token-sum-norm``
    also divides by the constant T).

    A batch split in parts aggregates to ``sum_p agg_loss(part p) * agg_count(part p) / agg_count(whole)``, whatever
    the split: the weight that makes micro-batches on any number of ranks add up to the whole mini-batch's loss.
    A host-side count (the mask lives on the host), so it costs no device sync.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    if loss_agg_mode == "token-mean":
        return float(loss_mask.double().sum())  # as `agg_loss` counts
    if loss_agg_mode == "seq-mean-token-mean":
        return float((loss_mask != 0).any(dim=-1).sum())
    return float(loss_mask.shape[0])
