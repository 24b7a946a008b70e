"""Variable-length attention for packed rows (padding-free training), without the flash-attn package.

A packed row holds the valid tokens of several sequences back to back, their ``position_ids`` restarting at 0 at
each sequence start. Attention must stay inside each sequence. transformers' sdpa path does that with a dense
block-diagonal (T x T) mask: exact, but it computes attention over the whole row (T^2 instead of sum of s_i^2, ~30x
more work for 32 sequences of 512 tokens) and stores the mask. This module registers an attention implementation,
``easyrl_varlen``, that cuts the row at the sequence starts (``cu_seqlens``) and runs

* on CUDA: torch's own flash-attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, forward and
  backward), whose signature changed across torch releases (``is_causal`` in 2.10, ``window_size`` and
  ``enable_gqa`` later): the call adapts to the installed one. Grouped-query attention (fewer key/value heads than
  query heads) runs natively wherever the kernel takes it: through ``enable_gqa`` where the signature has it, or
  with the fewer heads passed straight in where a one-time probe on tiny tensors (`gqa_support`) shows the
  flash kernel underneath accepts them and agrees with repeated heads (torch 2.11 has no flag). Only where neither
  holds are the key/value heads repeated (``Hq / Hkv`` times the K/V memory and traffic of every layer);
* elsewhere: causal sdpa on each sequence in turn (exact; what the CPU tests run).

Registered without a mask function, so transformers builds no mask at all for it (it passes ``None``); the function
refuses anything but a single packed row with its ``position_ids``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)

__all__ = [
    "VARLEN_ATTENTION",
    "attention_kernel",
    "cu_seqlens",
    "gqa_mode",
    "gqa_support",
    "register_varlen_attention",
    "repeat_kv_heads",
    "varlen_attention_forward",
]

VARLEN_ATTENTION = "easyrl_varlen"
"""The ``attn_implementation`` name models are loaded with for packed training."""

# One entry, keyed by identity (`is`): every attention layer of a pass is handed the same position_ids object. The
# entry keeps that tensor alive, so no later tensor can be mistaken for it.
_cache: dict[str, Any] = {}


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_len)`` of a packed row: int32 offsets of each sequence start plus the row length.

    The result for the last ``position_ids`` tensor seen is kept, since every layer of a forward pass asks for it.
    """
    if _cache.get("key") is position_ids:
        return _cache["cu"], _cache["max"]
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)  # each sequence starts at position 0
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("a packed row must start a sequence at position 0")
    total = torch.tensor([flat.numel()], device=flat.device)  # the row's end closes the last sequence
    cu = torch.cat([starts, total]).to(torch.int32)  # int32 offsets, as the flash varlen kernels take them
    max_len = int(cu.diff().max())  # a host sync: once per pass, thanks to the cache
    _cache.update(key=position_ids, cu=cu, max=max_len)
    return cu, max_len


def _segment_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence on its own: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)."""
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for start, end in itertools.pairwise(cu.tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, s, D)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
    return torch.cat(parts, dim=1).transpose(0, 1)  # (H, T, D) -> (T, H, D)


GqaMode = Literal["flag", "native", "repeat"]
"""How `varlen_attn` gets fewer key/value heads: ``enable_gqa=True``, passed as they are, or repeated first."""


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The argument names of the installed torch's ``varlen_attn`` (read once, not at every layer of every pass)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def gqa_mode(params: frozenset[str], takes_fewer_kv_heads: Callable[[], bool]) -> GqaMode:
    """How to call a `varlen_attn` with argument names `params` for GQA: ``flag`` where it has ``enable_gqa``;
    else ``native`` if `takes_fewer_kv_heads()` (the probe) says the kernel accepts them unflagged; else ``repeat``."""
    if "enable_gqa" in params:
        return "flag"
    return "native" if takes_fewer_kv_heads() else "repeat"


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor, query_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v (T, Hkv, D) with each head repeated for its group of query heads: (T, Hq, D) (what a kernel without GQA
    needs; query head h uses key/value head h // (Hq / Hkv), as in every GQA model)."""
    groups = query_heads // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _varlen_call_kwargs(params: frozenset[str], scale: float, head_dim: int) -> dict[str, Any]:
    """Causal masking and the scale, spelled the way the installed `varlen_attn` takes them."""
    # Releases without `is_causal` spell causal as the window (-1, 0): unbounded to the left, nothing to the right.
    kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kwargs["scale"] = scale
    # Without a `scale` argument the kernel uses 1/sqrt(D): only a model that wants exactly that can run.
    elif abs(scale - head_dim**-0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument and the model needs {scale}")
    return kwargs


def _probe_unflagged_gqa() -> bool:
    """Whether this torch's `varlen_attn` (CUDA) takes 2 key/value heads for 4 query heads without a flag, forward
    and backward, and agrees with repeated heads. Its flash kernel supports GQA; whether the Python wrapper lets the
    fewer heads through differs by release, so it is tried once instead of guessed from the version."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Two sequences (5 + 7 tokens), 4 query and 2 key/value heads, in bf16 (flash kernels take half precision only).
    q, k, v = (
        torch.randn(12, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for h in (4, 2, 2)
    )
    cu = torch.tensor([0, 5, 12], device="cuda", dtype=torch.int32)
    kwargs = _varlen_call_kwargs(params, 64**-0.5, 64)
    try:
        out = varlen_attn(q, k, v, cu, cu, 7, 7, **kwargs)  # max_q = max_k = 7, the longer sequence
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    except (RuntimeError, ValueError) as err:  # the wrapper or kernel refuses fewer heads: repeat them
        logger.info("varlen_attn takes no fewer key/value heads unflagged (%s): repeating them", err)
        return False
    # The reference: the same attention with the key/value heads repeated, which every release accepts.
    kr, vr = repeat_kv_heads(k.detach(), v.detach(), 4)
    ref = varlen_attn(q.detach(), kr, vr, cu, cu, 7, 7, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    grads_ok = k.grad is not None and k.grad.shape == k.shape  # the backward summed back to 2 heads
    return grads_ok and torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@functools.cache
def gqa_support() -> GqaMode:
    """This process's `gqa_mode` for torch's varlen kernel on CUDA, decided once (the probe runs at most once)."""
    return gqa_mode(_varlen_params(), _probe_unflagged_gqa)


def attention_kernel(padding_free: bool) -> str:
    """The attention kernel packed training runs in this process, and whether GQA is native: for `easyrl check`."""
    import importlib.util

    if not padding_free:
        return "transformers' default attention over padded rows (padding_free=false)"
    if not torch.cuda.is_available():
        return f"{VARLEN_ATTENTION}: per-sequence sdpa (CPU), GQA native (enable_gqa)"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2 (the flash-attn package, varlen), GQA native"
    mode = gqa_support()
    gqa = {"flag": "GQA native (enable_gqa)", "native": "GQA native (fewer K/V heads accepted)"}.get(
        mode, "GQA by repeating K/V heads (this torch's varlen_attn takes no fewer heads)"
    )
    return f"{VARLEN_ATTENTION}: torch {torch.__version__} varlen_attn (flash), {gqa}"


def _torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """torch's flash-attention varlen kernel (CUDA), called the way the installed torch spells it."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs = _varlen_call_kwargs(params, scale, q.shape[-1])
    if q.shape[1] != k.shape[1]:
        mode = gqa_support()  # "native" needs nothing: the fewer heads go in as they are
        if mode == "flag":
            kwargs["enable_gqa"] = True
        elif mode == "repeat":
            k, v = repeat_kv_heads(k, v, q.shape[1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (T, H, D) views of (H, T, D) tensors
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # the output alone, should a release return (output, lse)


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
    cu, max_len = cu_seqlens(position_ids)  # computed by the pass's first layer, cached for the rest
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if q.is_cuda:
        out = _torch_varlen(q, k, v, cu, max_len, scale)
    else:
        out = _segment_sdpa(q, k, v, cu, scale)
    return out.unsqueeze(0), None  # (1, T, Hq, D): the layout transformers' attention functions return


def register_varlen_attention() -> str:
    """Make ``attn_implementation="easyrl_varlen"`` loadable in this process (idempotent); returns the name."""
    from transformers import AttentionInterface

    # a global registry: any model loaded afterwards can name it
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION
