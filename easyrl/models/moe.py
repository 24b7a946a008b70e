"""Which experts a mixture-of-experts model sends each token to, read off its routers, and how two runs disagree.

The trainer and the rollout engine compute a token's router logits with different kernels (and, on GPUs, often
different precisions), so a token whose k-th and (k+1)-th expert scores are nearly tied can go to another expert in
the engine than in the trainer: its log-probs then differ by far more than float noise, and the importance ratio of
the update absorbs the difference. `routing_mismatch` measures how often that happens; router replay (recording the
engine's choices and forcing them in the trainer) is the known remedy, not implemented here (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


__all__ = ["recorded_router_logits", "router_modules", "routing_mismatch"]


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`, in layer order: transformers' MoE blocks name theirs ``mlp.gate`` (a module with the
    (experts, hidden) weight and ``top_k``); dense layers and shared-expert gates have none."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


@contextmanager
def recorded_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block every forward of `model` appends each router's logits, (tokens, experts) fp32 on the CPU, to
    the yielded list (layer after layer, pass after pass)."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out  # transformers' routers return (logits, scores, indices)
        seen.append(logits.detach().float().reshape(-1, logits.shape[-1]).cpu())

    handles = [m.register_forward_hook(hook) for m in router_modules(model)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def routing_mismatch(a: list[torch.Tensor], b: list[torch.Tensor], top_k: int) -> dict[str, float]:
    """How two runs' routers (lists of (tokens, experts) logits, layer by layer, same tokens) disagree.

    ``moe/route_mismatch``: the share of (layer, token) pairs whose top-k expert *sets* differ; ``moe/route_mismatch_
    tokens``: the share of tokens with such a pair in some layer; ``moe/router_logit_diff_max``: the largest logit
    difference; ``moe/topk_margin_min``: the smallest gap between the k-th and (k+1)-th logit in `a` (what a
    difference has to exceed to flip a choice).
    """
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError(
            f"the runs differ in layers or tokens: {[tuple(x.shape) for x in a]} vs {[tuple(y.shape) for y in b]}"
        )
    flips = []
    margins = []
    for x, y in zip(a, b):
        sx = torch.zeros_like(x, dtype=torch.bool).scatter_(1, x.topk(top_k, dim=1).indices, True)
        sy = torch.zeros_like(y, dtype=torch.bool).scatter_(1, y.topk(top_k, dim=1).indices, True)
        flips.append((sx != sy).any(dim=1))  # (tokens,)
        ranked = x.sort(dim=1, descending=True).values
        if x.shape[1] > top_k:
            margins.append((ranked[:, top_k - 1] - ranked[:, top_k]).min())
    per_pair = torch.stack(flips)  # (layers, tokens)
    return {
        "moe/route_mismatch": float(per_pair.float().mean()),
        "moe/route_mismatch_tokens": float(per_pair.any(dim=0).float().mean()),
        "moe/router_logit_diff_max": float(max((x - y).abs().max() for x, y in zip(a, b))),
        "moe/topk_margin_min": float(min(margins)) if margins else float("inf"),
    }
