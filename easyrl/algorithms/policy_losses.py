"""Built-in policy-gradient losses: PPO (with dual clip), GSPO (sequence and token forms), CISPO and SAPO.

All take ``(B, T)`` tensors by keyword and return ``(scalar loss, metrics)`` where the metrics are detached 0-dim
tensors on the loss's device: the update loop sums them on the device and reads them once per mini-batch (a
``float()`` here would stall the device on every micro-batch). Each loss registers the frozen dataclass of the knobs
it reads (``PpoParams``, ``ClipParams``, ``SapoParams``): the driver fills it from ``worker.actor`` by field name and
the loss gets it as ``params``, so a loss never sees another's knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from easyrl.algorithms.aggregation import agg_loss, masked_mean
from easyrl.algorithms.registry import register_policy_loss


__all__ = [
    "ClipParams",
    "PpoParams",
    "SapoParams",
    "compute_cispo_loss",
    "compute_gspo_loss",
    "compute_gspo_token_loss",
    "compute_ppo_loss",
    "compute_sapo_loss",
]

_LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before exp: beyond that the ratio is meaningless and exp overflows fp32/bf16."""


@dataclass(frozen=True)
class PpoParams:
    """`ppo`'s knobs (`worker.actor.*`)."""

    clip_ratio_low: float
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: float
    clip_ratio_dual: float
    """Dual-clip constant, > 1: the loss of a negative-advantage token is capped at -A * clip_ratio_dual."""

    def __post_init__(self) -> None:
        if self.clip_ratio_dual <= 1.0:
            raise ValueError(f"clip_ratio_dual must be > 1, got {self.clip_ratio_dual}")


@dataclass(frozen=True)
class ClipParams:
    """The two-sided clip range of `gspo`, `gspo_token` and `cispo` (`worker.actor.*`): no dual clip."""

    clip_ratio_low: float
    """The ratio (GSPO) or the IS weight (CISPO) is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: float


@dataclass(frozen=True)
class SapoParams:
    """`sapo`'s gate temperatures (`worker.actor.*`), both > 0."""

    tau_positive: float
    """Temperature where the advantage is non-negative."""
    tau_negative: float
    """Temperature where the advantage is negative."""

    def __post_init__(self) -> None:
        if self.tau_positive <= 0 or self.tau_negative <= 0:
            raise ValueError(
                f"SAPO temperatures must be > 0, got tau_positive={self.tau_positive}, "
                f"tau_negative={self.tau_negative}"
            )


def _apply_is_weights(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Multiply truncated importance-sampling weights (B, T) into the per-token loss, without gradient."""
    if rollout_is_weights is None:
        return loss_mat
    return loss_mat * rollout_is_weights.detach().to(loss_mat.dtype)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped loss per token, optionally with the dual clip for negative advantages.

    Args:
        ratio: (B, T) importance ratio pi / pi_old.
        advantages: (B, T).
        clip_ratio_low, clip_ratio_high: the ratio is clipped to [1 - low, 1 + high].
        clip_ratio_dual: cap for negative-advantage losses (``-A * clip_ratio_dual``); None disables it.

    Returns:
        ``(loss_mat, clipped, dual_clipped)``: (B, T) loss and two (B, T) bool masks of the active branches.
    """
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped  # strictly: where the branches tie the token counts as unclipped
    if clip_ratio_dual is None:
        return loss_mat, clipped, torch.zeros_like(clipped)
    # With A < 0 and a huge ratio the max() above grows without bound; the dual clip caps it at -A * c.
    loss_dual = -advantages * clip_ratio_dual
    negative = advantages < 0
    dual_clipped = negative & (loss_mat > loss_dual)
    loss_mat = torch.where(negative, torch.minimum(loss_mat, loss_dual), loss_mat)
    return loss_mat, clipped, dual_clipped


@register_policy_loss("ppo", params=PpoParams)
@register_policy_loss("vanilla", params=PpoParams)
def compute_ppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    params: PpoParams,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with dual clip.

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``;
    ``L = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` and, where ``A < 0``, ``L = min(L, -A * dual)``;
    then optionally ``L *= rollout_is_weights`` and ``agg_loss(L, response_mask, loss_agg_mode)``.

    Args:
        old_log_prob: (B, T) log-probs of the sampling policy.
        log_prob: (B, T) log-probs of the current policy (with grad).
        advantages: (B, T).
        response_mask: (B, T).
        params: the clip range [1 - low, 1 + high] and the dual-clip constant.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: optional (B, T) truncated IS weights.

    Returns:
        ``(loss, metrics)``: scalar loss; metrics ``pg_clipfrac`` (fraction of valid tokens on the clipped branch),
        ``pg_clipfrac_lower`` (fraction where the dual clip is active) and ``ppo_kl`` (mean of
        ``old_log_prob - log_prob`` over valid tokens).
    """
    log_ratio = (log_prob - old_log_prob).clamp(min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    loss_mat, clipped, dual_clipped = _clipped_surrogate(
        ratio, advantages, params.clip_ratio_low, params.clip_ratio_high, params.clip_ratio_dual
    )
    loss_mat = _apply_is_weights(loss_mat, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return loss, _clip_metrics(clipped, dual_clipped, old_log_prob, log_prob, response_mask)


def _gspo_log_ratio(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor, token_level: bool
) -> torch.Tensor:
    """(B, T) log of GSPO's ratio: the length-normalised sequence log-ratio on every token.

    Sequence form: the mean itself, so each token's loss has gradient through every token of its sequence.
    Token form: ``sg(mean) + log_prob - sg(log_prob)``, the same value, with gradient only through its own token.
    """
    mask_f = response_mask.to(log_prob.dtype)
    log_ratio_tok = log_prob - old_log_prob
    n_valid = mask_f.sum(dim=-1).clamp(min=1.0)  # (B,); fully masked rows have no tokens to weigh anyway
    # where(), not a product: a -inf log-prob on a padding token would turn 0 * inf into nan.
    seq_log_ratio = torch.where(mask_f != 0, log_ratio_tok, torch.zeros_like(log_ratio_tok)).sum(dim=-1) / n_valid
    if token_level:
        # Value: the sequence log-ratio; gradient: 1 w.r.t. the token's own log-prob, 0 w.r.t. the others.
        return seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    # (B, T) view: each token's loss reaches the whole sequence's mean
    return seq_log_ratio.unsqueeze(-1).expand_as(log_prob)


def _gspo(
    token_level: bool,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Both GSPO forms: the clipped surrogate on `_gspo_log_ratio`'s ratio (see the two public losses)."""
    log_ratio = _gspo_log_ratio(old_log_prob, log_prob, response_mask, token_level)
    ratio = torch.exp(log_ratio.clamp(min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT))
    loss_mat, clipped, dual_clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high, None)
    loss_mat = _apply_is_weights(loss_mat, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return loss, _clip_metrics(clipped, dual_clipped, old_log_prob, log_prob, response_mask)


@register_policy_loss("gspo", params=ClipParams)
def compute_gspo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    params: ClipParams,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO clipping on a length-normalised sequence ratio, shared by all tokens of the sequence.

    ``r_i = exp(mean_{valid t} (log_prob - old_log_prob))`` on every token of sequence i, with its gradient (each
    token's loss reaches every token of the sequence, weighted ``1 / |y_i|``). Then
    ``L = max(-A * r_i, -A * clip(r_i, 1 - low, 1 + high))`` -- the two-sided clip of the GSPO paper (no dual clip).
    With one advantage per sequence (every group estimator) its gradient equals ``gspo_token``'s; they differ when
    advantages vary along a sequence.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T).
        params: the clip range (GSPO uses much smaller values than PPO, e.g. 3e-4 / 4e-4).
        loss_agg_mode: see ``agg_loss`` (the paper uses ``seq-mean-token-mean``).
        rollout_is_weights: optional (B, T) truncated IS weights.

    Returns:
        ``(loss, metrics)`` with ``pg_clipfrac``, ``pg_clipfrac_lower`` (always 0) and ``ppo_kl``.
    """
    return _gspo(
        False, old_log_prob, log_prob, advantages, response_mask, params.clip_ratio_low, params.clip_ratio_high,
        loss_agg_mode, rollout_is_weights,
    )  # fmt: skip


@register_policy_loss("gspo_token", params=ClipParams)
def compute_gspo_token_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    params: ClipParams,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token: GSPO's sequence ratio as each token's value, each token's own gradient.

    ``r_it = sg(r_i) * exp(log_prob_it - sg(log_prob_it))``: its value is ``r_i`` on every token while its
    gradient w.r.t. ``log_prob_it`` is ``r_i`` (and 0 w.r.t. the other tokens), so a sequence is clipped or kept as
    one while token-level advantages steer each token. Clip and arguments as in ``compute_gspo_loss``.

    Returns:
        ``(loss, metrics)`` with ``pg_clipfrac``, ``pg_clipfrac_lower`` (always 0) and ``ppo_kl``.
    """
    return _gspo(
        True, old_log_prob, log_prob, advantages, response_mask, params.clip_ratio_low, params.clip_ratio_high,
        loss_agg_mode, rollout_is_weights,
    )  # fmt: skip


@register_policy_loss("cispo", params=ClipParams)
def compute_cispo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    params: ClipParams,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    ``L = -sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob``. Unlike PPO, clipped tokens still receive gradient
    (scaled by the clipped weight); only the weight is bounded.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T).
        params: the bounds of the IS weight.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: optional (B, T) truncated IS weights.

    Returns:
        ``(loss, metrics)`` with ``pg_clipfrac`` (fraction of valid tokens whose weight was clipped),
        ``pg_clipfrac_lower`` (always 0) and ``ppo_kl``.
    """
    with torch.no_grad():
        log_ratio = (log_prob - old_log_prob).clamp(min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
        clipped = weight != ratio  # the weight hit a bound
    # The weight is a constant (no_grad above): the gradient is -weight * A * d log_prob, clipped tokens included.
    loss_mat = -weight * advantages * log_prob
    loss_mat = _apply_is_weights(loss_mat, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return loss, _clip_metrics(clipped, None, old_log_prob, log_prob, response_mask)


@register_policy_loss("sapo", params=SapoParams)
def compute_sapo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    params: SapoParams,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate on the token ratio in place of PPO's hard clip.

    ``f(r; tau) = (4 / tau) * sigmoid(tau * (r - 1))`` and ``L = -A * f(r; tau)`` with ``tau = tau_positive`` where
    ``A >= 0`` and ``tau_negative`` where ``A < 0``. At ``r = 1`` the gate's slope is 1 (the plain policy gradient);
    away from it the slope ``4 * s * (1 - s)`` (``s`` the sigmoid) decays smoothly instead of dropping to 0, faster
    for a larger ``tau``. Nothing is clipped, so the clip keys are not its knobs.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T).
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: optional (B, T) truncated IS weights.
        params: the gate temperatures (``worker.actor.tau_positive`` / ``tau_negative``), > 0.

    Returns:
        ``(loss, metrics)`` with ``pg_clipfrac`` and ``pg_clipfrac_lower`` (always 0: nothing is clipped) and
        ``ppo_kl``.
    """
    log_ratio = (log_prob - old_log_prob).clamp(min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages >= 0, params.tau_positive, params.tau_negative).to(ratio.dtype)  # (B, T)
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    loss_mat = _apply_is_weights(-advantages * gate, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return loss, _clip_metrics(
        torch.zeros_like(response_mask, dtype=torch.bool), None, old_log_prob, log_prob, response_mask
    )


@torch.no_grad()
def _clip_metrics(
    clipped: torch.Tensor,
    dual_clipped: torch.Tensor | None,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """verl-named statistics over valid tokens: clip fractions (B, T bool masks) and the approximate KL, as 0-dim
    tensors (no device sync)."""
    dual = torch.zeros_like(clipped) if dual_clipped is None else dual_clipped
    return {
        "pg_clipfrac": masked_mean(clipped.to(log_prob.dtype), response_mask),
        "pg_clipfrac_lower": masked_mean(dual.to(log_prob.dtype), response_mask),
        # k1 estimate of KL(old || current), on samples from old
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
    }
