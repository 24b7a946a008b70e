"""Clipped value (critic) loss."""

from __future__ import annotations

import torch

from easyrl.algorithms.aggregation import agg_loss, masked_mean


__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with clipping around the rollout-time values.

    ``v_clip = values + clamp(vpreds - values, -c, c)`` and
    ``L = 0.5 * max((vpreds - returns)^2, (v_clip - returns)^2)``, aggregated with ``loss_agg_mode``.

    Args:
        vpreds: (B, T) current critic predictions (with grad).
        returns: (B, T) regression targets.
        values: (B, T) critic predictions at rollout time.
        response_mask: (B, T).
        cliprange_value: clip range c.
        loss_agg_mode: see ``agg_loss``.

    Returns:
        ``(loss, metrics)``: scalar loss; ``vf_clipfrac`` (fraction of valid tokens where the clipped term is the
        larger one) and ``vpred_mean`` (mean prediction over valid tokens), detached 0-dim tensors.
    """
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss_unclipped = (vpreds - returns).square()
    loss_clipped = (vpred_clipped - returns).square()
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask),
            "vpred_mean": masked_mean(vpreds, response_mask),
        }
    return loss, metrics
