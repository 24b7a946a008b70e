"""Rollout correction: importance weights, rejection and veto between the policy that sampled (the rollout engine's
per-token log-probs, pi_rollout) and the policy the update starts from (pi_old), with verl's option names
(`algorithm.rollout_correction`, docs/algorithms.md "Rollout correction").

Everything reads one log-ratio per trained token, ``log r = log pi_old - log pi_rollout``, judged per token, per
sequence (the sum: the log of the product of the sequence's ratios) or geometrically (the mean over the sequence's
trained tokens). A ratio is exponentiated only after its log is clamped to +-20 (exp(20) ~ 4.9e8: past that a weight
means nothing and float32 overflows). Importance weights and rejection read the same ratios and ignore each other, as
in verl: the weights are computed over the trained tokens before any rejection, and rejection edits the loss mask
only, so a rejected token's weight is never used.

Where this departs from verl: every threshold is compared with the log-ratio itself rather than with the clamped
ratio, so a bound past e^+-20 still means what it says; the weight statistics are those of the weights the loss gets
(after truncation or masking and batch normalization) and add quantiles; the rejection band of the `sequence` mode
defaults its lower edge to 1 / upper like the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from easyrl.config.algorithm import RolloutCorrectionConfig


__all__ = [
    "IS_LEVELS",
    "RS_LEVELS",
    "SAFETY_BOUND",
    "Correction",
    "aggregate_log_ratio",
    "correct_rollout",
    "importance_weights",
    "log_ratios",
    "mismatch_metrics",
    "rejected_by_ratio",
    "vetoed",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-SAFETY_BOUND before exp."""
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Correction:
    """What `correct_rollout` gives the step."""

    weights: torch.Tensor | None
    """(B, T) importance weights, 0 off the trained tokens; None without `rollout_is`."""
    loss_mask: torch.Tensor
    """(B, T) the loss mask less the rejected and vetoed tokens (the input's dtype)."""
    metrics: dict[str, float]
    """`rollout_corr/*` statistics of this batch."""


def log_ratios(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) ``log pi_old - log pi_rollout`` on the trained tokens (`valid` (B, T) bool), 0 elsewhere."""
    # where(), not a product: a padding position may hold -inf, and 0 * inf is nan.
    return torch.where(valid, old_log_probs.float() - rollout_log_probs.float(), 0.0)


def aggregate_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """(B, T) the log-ratio each token is judged or weighted by: its own (`token`), its sequence's sum
    (`sequence`) or mean (`geometric`) on every token of the sequence. `log_ratio` is 0 off `valid`."""
    if level == "token":
        return log_ratio
    per_seq = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    if level == "geometric":
        per_seq = per_seq / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown rollout correction level {level!r}; choose one of {RS_LEVELS}")
    return per_seq.expand_as(log_ratio)


def _in_band(log_value: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """exp(log_value) in [lower, upper], decided in log space (a lower edge of 0 is no edge)."""
    low = math.log(lower) if lower > 0 else -math.inf
    return (log_value >= low) & (log_value <= math.log(upper))


def _fraction(hits: torch.Tensor, of: torch.Tensor) -> float:
    """Share of the True positions of `of` that are True in `hits` (0 when `of` has none)."""
    return float((hits & of).sum()) / max(int(of.sum()), 1)


def _quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """torch.quantile's linear interpolation, by one sort: torch.quantile refuses inputs over 2**24 elements (a
    batch of 16M tokens)."""
    ordered = values.double().sort().values
    last = ordered.numel() - 1
    out = []
    for q in qs:
        pos = q * last
        lo = math.floor(pos)
        hi = min(lo + 1, last)
        out.append(float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)))
    return out


def _weight_stats(weights: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Mean, std, min, max, quantiles and effective sample size fraction ``(sum w)^2 / (n sum w^2)`` of the weights on
    the trained tokens."""
    w = weights[valid].double()
    if w.numel() == 0:
        return {}
    square_sum = float((w * w).sum())
    stats = {
        "rollout_is_mean": float(w.mean()),
        "rollout_is_std": float(w.std(unbiased=False)),
        "rollout_is_min": float(w.min()),
        "rollout_is_max": float(w.max()),
        # 1 when all weights are equal, 1/n when one token carries all the weight.
        "rollout_is_eff_sample_size": float(w.sum()) ** 2 / (w.numel() * square_sum) if square_sum > 0 else 0.0,
    }
    for q, value in zip(QUANTILES, _quantiles(w, QUANTILES)):
        stats[f"rollout_is_p{round(q * 100)}"] = value
    return stats


def importance_weights(
    log_ratio: torch.Tensor,
    valid: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_old / pi_rollout, (B, T), 0 off `valid`.

    Truncated IS (`lower` None): ``w = min(r, upper)``. Masked IS / IcePop: ``w = r`` where ``lower <= r <= upper``,
    else 0 (the token stays in the loss's denominator with no weight). `level` token: r per token; sequence: the
    product of the sequence's ratios on each of its tokens. `batch_normalize` divides by the mean weight over the
    trained tokens (token) or over the sequences that have any (sequence).

    Args:
        log_ratio: (B, T) from `log_ratios` (0 off `valid`).
        valid: (B, T) bool, the trained tokens.

    Returns:
        ``(weights, metrics)``: the fractions clamped (truncated IS) and masked (IcePop), the batch normalization
        factor when on, and `_weight_stats` of the weights returned.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; choose one of {IS_LEVELS}")
    agg = aggregate_log_ratio(log_ratio, valid, level)
    ratio = torch.exp(agg.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    none = torch.zeros_like(valid)
    if lower is None:
        clamped, masked = valid & (agg > math.log(upper)), none
        weights = ratio.clamp(max=upper)
    else:
        inside = _in_band(agg, lower, upper)
        clamped, masked = none, valid & ~inside
        weights = torch.where(inside, ratio, 0.0)
    weights = torch.where(valid, weights, 0.0)
    metrics = {
        "rollout_is_clamped_fraction": _fraction(clamped, valid),
        "rollout_is_masked_fraction": _fraction(masked, valid),
    }
    if batch_normalize:
        if level == "token":
            mean = weights[valid].mean() if valid.any() else weights.new_zeros(())
        else:  # every trained token of a sequence holds its weight: average the sequences, not their tokens
            rows = valid.any(dim=-1)
            per_seq = weights.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
            mean = per_seq[rows].mean() if rows.any() else weights.new_zeros(())
        factor = float(mean)
        if factor > 1e-8:  # all weights masked: nothing to rescale
            weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    return weights, metrics | _weight_stats(weights, valid)


def rejected_by_ratio(
    log_ratio: torch.Tensor, valid: torch.Tensor, level: str, upper: float, lower: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling: the trained tokens (B, T) bool whose ratio (`level`: the token's own, the sequence's
    product, or its geometric mean) lies outside ``[lower, upper]`` (`lower` None: ``1 / upper``).

    Returns:
        ``(rejected, metrics)``: `rollout_rs_masked_fraction` (of the trained tokens) and
        `rollout_rs_seq_masked_fraction` (of the sequences: any token rejected).
    """
    agg = aggregate_log_ratio(log_ratio, valid, level)
    rejected = valid & ~_in_band(agg, 1.0 / upper if lower is None else lower, upper)
    return rejected, {
        "rollout_rs_masked_fraction": _fraction(rejected, valid),
        "rollout_rs_seq_masked_fraction": float(rejected.any(dim=-1).float().mean()),
    }


def vetoed(log_ratio: torch.Tensor, valid: torch.Tensor, threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Veto: every trained token (B, T) bool of a sequence holding a token whose ratio is below `threshold`.

    Judged on the token's own log-ratio, unclamped: a catastrophic token far past e^-20 is still caught.

    Returns:
        ``(rejected, metrics)``: `rollout_is_veto_fraction` (of the sequences) and
        `rollout_is_catastrophic_token_fraction` (of the trained tokens).
    """
    catastrophic = valid & (log_ratio < math.log(threshold))
    sequences = catastrophic.any(dim=-1, keepdim=True)  # (B, 1)
    return valid & sequences, {
        "rollout_is_veto_fraction": float(sequences.float().mean()),
        "rollout_is_catastrophic_token_fraction": _fraction(catastrophic, valid),
    }


def mismatch_metrics(log_ratio: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """KL(pi_rollout || pi_old) over the trained tokens (the engine sampled them): `kl`, the k1 estimate
    ``mean(-log r)``, and `k3_kl`, ``mean(r - 1 - log r)`` (never negative, lower variance)."""
    lr = log_ratio[valid].double().clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    if lr.numel() == 0:
        return {}
    return {"kl": float(-lr.mean()), "k3_kl": float((torch.exp(lr) - 1.0 - lr).mean())}


def correct_rollout(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> Correction:
    """The corrections `cfg` turns on, over one batch.

    Args:
        old_log_probs: (B, T) pi_old of the sampled tokens (the actor's old-log-prob pass).
        rollout_log_probs: (B, T) pi_rollout of the same tokens (the engine's).
        loss_mask: (B, T) the trained tokens.
        cfg: the resolved settings (`AlgorithmConfig.correction`: `tis_cap` applied).

    Returns:
        A `Correction`: the importance weights (with `rollout_is`), the loss mask less what rejection sampling and
        the veto threw out, and the `rollout_corr/*` metrics (the mismatch KL always).
    """
    valid = loss_mask.bool()
    log_ratio = log_ratios(old_log_probs, rollout_log_probs, valid)
    metrics = mismatch_metrics(log_ratio, valid)
    weights = None
    if cfg.rollout_is is not None:
        weights, is_metrics = importance_weights(
            log_ratio, valid, cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_threshold_lower,
            cfg.rollout_is_batch_normalize,
        )  # fmt: skip
        metrics |= is_metrics
    rejected = torch.zeros_like(valid)
    if cfg.rollout_rs is not None:
        if cfg.rollout_rs_threshold is None:  # config validation asks for it; a direct caller learns here
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        by_ratio, rs_metrics = rejected_by_ratio(
            log_ratio, valid, cfg.rollout_rs, cfg.rollout_rs_threshold, cfg.rollout_rs_threshold_lower
        )
        rejected |= by_ratio
        metrics |= rs_metrics
    if cfg.rollout_token_veto_threshold is not None:
        by_veto, veto_metrics = vetoed(log_ratio, valid, cfg.rollout_token_veto_threshold)
        rejected |= by_veto
        metrics |= veto_metrics
    kept = loss_mask * (~rejected).to(loss_mask.dtype)
    return Correction(weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()})
