"""Variable-length attention for packed rows (padding-free training), without the flash-attn package.

A packed row holds the valid tokens of several sequences back to back, their ``position_ids`` restarting at 0 at
each sequence start. Attention must stay inside each sequence. transformers' sdpa path does that with a dense
block-diagonal (T x T) mask: exact, but it computes attention over the whole row (T^2 instead of sum of s_i^2, ~30x
more work for 32 sequences of 512 tokens) and stores the mask. This module registers an attention implementation,
``easyrl_varlen``, that cuts the row at the sequence starts (``cu_seqlens``) and runs

* on CUDA: torch's own flash-attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, forward and
  backward), whose signature changed across torch releases (``is_causal`` in 2.10, ``window_size`` and
  ``enable_gqa`` later): the call adapts to the installed one;
* elsewhere: causal sdpa on each sequence in turn (exact; what the CPU tests run).

Registered without a mask function, so transformers builds no mask at all for it (it passes ``None``); the function
refuses anything but a single packed row with its ``position_ids``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F


__all__ = ["VARLEN_ATTENTION", "cu_seqlens", "register_varlen_attention", "varlen_attention_forward"]

VARLEN_ATTENTION = "easyrl_varlen"
"""The ``attn_implementation`` name models are loaded with for packed training."""

_cache: dict[str, Any] = {}


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_len)`` of a packed row: int32 offsets of each sequence start plus the row length.

    The result for the last ``position_ids`` tensor seen is kept, since every layer of a forward pass asks for it.
    """
    if _cache.get("key") is position_ids:
        return _cache["cu"], _cache["max"]
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("a packed row must start a sequence at position 0")
    total = torch.tensor([flat.numel()], device=flat.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    max_len = int(cu.diff().max())
    _cache.update(key=position_ids, cu=cu, max=max_len)
    return cu, max_len


def _segment_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence on its own: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)."""
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for start, end in itertools.pairwise(cu.tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, s, D)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
    return torch.cat(parts, dim=1).transpose(0, 1)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The argument names of the installed torch's ``varlen_attn`` (read once, not at every layer of every pass)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """torch's flash-attention varlen kernel (CUDA), called the way the installed torch spells it."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs: dict[str, Any] = {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument and the model needs {scale}")
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (T, H, D) views of (H, T, D) tensors
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D)."""
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None:
        raise RuntimeError(
            f"{VARLEN_ATTENTION} attention takes one packed row with its position_ids (padding-free training); got "
            f"batch {query.shape[0]}, position_ids {'missing' if position_ids is None else 'given'}, "
            f"mask {'given' if attention_mask is not None else 'none'}"
        )
    if sliding_window is not None or dropout:
        raise RuntimeError(f"{VARLEN_ATTENTION} attention does not do sliding windows or attention dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cu, max_len = cu_seqlens(position_ids)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if q.is_cuda:
        out = _torch_varlen(q, k, v, cu, max_len, scale)
    else:
        out = _segment_sdpa(q, k, v, cu, scale)
    return out.unsqueeze(0), None


def register_varlen_attention() -> str:
    """Make ``attn_implementation="easyrl_varlen"`` loadable in this process (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION
