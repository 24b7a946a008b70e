"""The fused head's Triton path (`worker.actor.fused_head_kernel: triton`): the same outputs and gradients as
`easyrl.workers.packing.FusedLinearLogProbs`, without its fp32 (chunk, V) blocks.

The matmuls stay in torch (tensor cores, the model's dtype in and out); Triton does the row-wise work on the logits
blocks in the model's dtype, reading each once with fp32 math in registers:

- forward (`_forward_rows`), by (chunk, V) blocks of token rows: one pass of online softmax per row gives the
  label's log-prob, the entropy (or the top-1 flag) and, saved for the backward, the row's `lse` and `E_p[z]` (two
  floats per row, not a (chunk, V) block);
- backward (`_backward_rows`), by (N, c) blocks of vocabulary columns (`easyrl.workers.head_grad`, shared with the
  torch head: no fp32 (V, H) buffer): each block's logits are recomputed into one buffer, and the kernel overwrites
  them in place, in the model's dtype, with d/dz of `g_lp * logp + g_H * H` divided by the temperature:
  `g_lp * (onehot - p) - g_H * p * (z - E_p[z])`. Then grad_W[c] = grad_z^T @ h and grad_h += grad_z @ W[c].

Interpreter: with `TRITON_INTERPRET=1` set before this module is imported (`triton.jit` reads it when it decorates)
the kernels run on CPU tensors through numpy; that is how the CPU tests check them. Otherwise CUDA only.

This module is the only one that imports triton, and only `easyrl.workers.packing` imports it, lazily, when the
switch asks for it (tests/test_structure_rules.py holds both).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from easyrl.workers.head_grad import backward_by_vocab_blocks


INTERPRETED = bool(triton.knobs.runtime.interpret)
"""The kernels below were decorated in interpreter mode (TRITON_INTERPRET=1 at import): they take CPU tensors."""

_MAX_BLOCK_V = 4096
"""Vocabulary columns per tile: 4096 fp32 values per row in registers over 8 warps (16 per thread)."""


@triton.jit
def _forward_rows(
    logits_ptr,
    labels_ptr,
    logp_ptr,
    second_ptr,
    lse_ptr,
    mean_z_ptr,
    stride,
    vocab,
    temperature,
    TOP1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 at 1024 rows x 151k vocab x 16
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    # Running max, sum of exp(z - max), sum of exp(z - max) * z, and the first index of the max (torch's argmax).
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    arg = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        tile_max = tl.max(z, axis=0)
        if TOP1:
            tile_arg = tl.min(tl.where(z == tile_max, offs, vocab), axis=0).to(tl.int64)
            arg = tl.where(tile_max > m, tile_arg, arg)  # strictly greater: an earlier tile keeps a tie
        new_m = tl.maximum(m, tile_max)
        alpha = tl.exp(m - new_m)
        e = tl.exp(z - new_m)
        s = s * alpha + tl.sum(e, axis=0)
        # z is -inf at the masked tail and e there 0: 0 * -inf would be NaN, so those columns weigh a 0 instead
        t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
        m = new_m
    lse = m + tl.log(s)
    mean_z = t / s  # E_p[z]
    z_label = tl.load(base + label).to(tl.float32) / temperature
    tl.store(logp_ptr + row, z_label - lse)
    if TOP1:
        tl.store(second_ptr + row, (arg == label).to(tl.float32))
    else:
        tl.store(second_ptr + row, lse - mean_z)  # H = -sum p (z - lse) = lse - E_p[z]
    tl.store(lse_ptr + row, lse)
    tl.store(mean_z_ptr + row, mean_z)


@triton.jit
def _backward_rows(
    logits_ptr,
    labels_ptr,
    lse_ptr,
    mean_z_ptr,
    grad_logp_ptr,
    grad_ent_ptr,
    stride,
    col0,
    cols,
    temperature,
    HAS_GLP: tl.constexpr,
    HAS_GH: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    mean_z = tl.load(mean_z_ptr + row)
    for start in range(0, cols, BLOCK_V):  # the row's columns col0 .. col0 + cols of the vocabulary
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < cols
        x = tl.load(base + offs, mask=mask, other=0.0)
        z = x.to(tl.float32) / temperature
        p = tl.exp(z - lse)
        grad = tl.zeros([BLOCK_V], tl.float32)
        if HAS_GLP:
            g_lp = tl.load(grad_logp_ptr + row)
            grad += g_lp * (tl.where(offs + col0 == label, 1.0, 0.0) - p)  # d logp / dz = onehot - p
        if HAS_GH:
            g_h = tl.load(grad_ent_ptr + row)
            grad -= g_h * p * (z - mean_z)  # dH / dz = -p (z - E_p[z])
        # chain rule through z = logits / T; written over the logits it was computed from (read before, same program)
        tl.store(base + offs, (grad / temperature).to(x.dtype), mask=mask)


def _block_v(vocab: int) -> int:
    """The tile width: the vocabulary rounded up to a power of two, capped at `_MAX_BLOCK_V` (read at call time:
    the CPU tests narrow it to run several tiles and a masked tail on a tiny vocabulary)."""
    return min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))


def _launch_options(block: int) -> dict[str, int]:
    """Warps per row program: 8 for the full-width tile (register pressure), fewer for narrow tiles."""
    return {"num_warps": 8 if block >= 2048 else 4}


class TritonLinearLogProbs(torch.autograd.Function):
    """(N, H) hidden, (V, H) head weight, (N,) labels -> (N,) fp32 log-probs and (N,) entropy (or top-1 flags), by
    token chunks; the contract of `FusedLinearLogProbs`.

    Memory: one (chunk, V) logits buffer in the model's dtype (reused by every chunk of the forward; the backward's
    blocks hold as many logits); per row two fp32 floats kept from the forward. No fp32 (chunk, V) block, and no
    (V, H) buffer but the weight's gradient itself.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk: int,
        second: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        block = _block_v(vocab)
        # logp, second, lse, E_p[z]: four tensors, not views of one (a caller may write into what it is returned)
        stats = [hidden.new_empty(n, dtype=torch.float32) for _ in range(4)]
        if n:
            buf = hidden.new_empty(min(chunk, n), vocab)  # (chunk, V) in the model's dtype
            for start in range(0, n, chunk):
                rows = min(chunk, n - start)
                logits = torch.mm(hidden[start : start + rows], weight.T, out=buf[:rows])
                logp, sec, lse, mean_z = (s[start : start + rows] for s in stats)
                _forward_rows[(rows,)](
                    logits,
                    labels[start : start + rows],
                    logp,
                    sec,
                    lse,
                    mean_z,
                    logits.stride(0),
                    vocab,
                    float(temperature),
                    TOP1=second == "top1",
                    BLOCK_V=block,
                    **_launch_options(block),
                )
        ctx.save_for_backward(hidden, weight, labels, stats[2], stats[3])
        ctx.temperature, ctx.chunk, ctx.second = temperature, chunk, second
        return stats[0], stats[1]

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        has_gh = grad_ent is not None and ctx.second == "entropy"  # a top-1 flag has no gradient
        dummy = lse  # an unused pointer argument (its constexpr flag is off)
        g_lp = grad_logp.float().contiguous() if grad_logp is not None else dummy
        g_h = grad_ent.float().contiguous() if has_gh else dummy  # type: ignore[union-attr]

        def grad_block(start: int, end: int, logits: torch.Tensor) -> torch.Tensor:
            # The block's logits (N, c), recomputed into the shared buffer, overwritten with grad_z in place
            block = _block_v(end - start)
            _backward_rows[(logits.shape[0],)](
                logits,
                labels,
                lse,
                mean_z,
                g_lp,
                g_h,
                logits.stride(0),
                start,
                end - start,
                float(ctx.temperature),
                HAS_GLP=grad_logp is not None,
                HAS_GH=has_gh,
                BLOCK_V=block,
                **_launch_options(block),
            )
            return logits  # grad_z, (N, c) in the model's dtype, as the torch head's before its matmuls

        grads = backward_by_vocab_blocks(
            hidden, weight, ctx.chunk, grad_block, ctx.needs_input_grad[:2], logits_buffer=True
        )
        return *grads, None, None, None, None  # labels, temperature, chunk, second: no gradient


def triton_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int,
    second: str = "entropy",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_linear_logprobs` on the Triton kernels (its arguments checked there)."""
    if not (hidden.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"worker.actor.fused_head_kernel=triton runs on CUDA, the head's input is on {hidden.device} (CPU needs "
            "TRITON_INTERPRET=1 set before easyrl.workers.head_kernel is imported: tests only): set it to torch"
        )
    out = TritonLinearLogProbs.apply(
        hidden.contiguous(), weight.contiguous(), labels.contiguous(), temperature, chunk_size, second
    )
    return out[0], out[1]
