"""The supervised fine-tuning objective: negative log-likelihood of the trained tokens, and what validation reports.

Shapes: (b, R) over a micro-batch's response grid (`easyrl.data.sft.collate_sft`); `loss_mask` is 1 on the assistant
tokens. The loss is aggregated like every RL loss (`agg_loss`, `worker.actor.loss_avg_mode`; `token-mean` by
default, each trained token weighing the same), so the update loop's micro-batch and rank weights apply as they are.
"""

from __future__ import annotations

import math

import torch

from easyrl.algorithms.aggregation import agg_loss


__all__ = ["nll_loss", "token_accuracy", "validation_metrics"]


def nll_loss(log_prob: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Scalar: `-log p(token)` (b, R) aggregated over `loss_mask` (b, R) with `loss_agg_mode`; 0 with no token."""
    return agg_loss(loss_mat=-log_prob, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode)


def token_accuracy(top1: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Scalar: the share of trained tokens (`loss_mask` (b, R)) the model ranks first (`top1` (b, R), 1 where the
    label is the argmax of its logits); 0 with no token."""
    return agg_loss(loss_mat=top1.float(), loss_mask=loss_mask, loss_agg_mode="token-mean")


def validation_metrics(nll_sum: float, top1_sum: float, tokens: float) -> dict[str, float]:
    """`val/loss` (per-token NLL, whatever `loss_avg_mode` trains with, so runs compare), `val/token_accuracy`,
    `val/perplexity` (exp of the loss) and `val/tokens`, from sums over every trained token of the validation set."""
    if tokens <= 0:
        raise ValueError("validation found no trained token: every validation row has an empty loss mask")
    loss = nll_sum / tokens
    return {
        "val/loss": loss,
        "val/token_accuracy": top1_sum / tokens,
        "val/perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
        "val/tokens": tokens,
    }
