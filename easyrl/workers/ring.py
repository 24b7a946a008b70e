"""Ring attention: causal packed attention over a row whose tokens are split in contiguous blocks over a ring of ranks.

Layout (with Ulysses, `easyrl.workers.ulysses`): a sequence-parallel group of ``ulysses x ring`` ranks splits each
packed row into ``ulysses x ring`` contiguous shards, shard ``s`` on group rank ``s`` (the split Ulysses alone uses, so
the sharding, the gathering of results and the vision-language split after the embeddings are unchanged). Group rank
``s`` is Ulysses index ``s % ulysses`` of ring index ``s // ulysses``: the Ulysses all-to-all among the ``ulysses``
ranks of one ring index gives each of them the contiguous block ``s // ulysses`` (``T / ring`` tokens) of
``heads / ulysses`` heads; the ring then joins the ranks of one Ulysses index, which hold the same heads and the
``ring`` blocks of the row. Activations per rank are ``T / (ulysses x ring)`` tokens; attention's key/value per rank
are two blocks of ``T / ring`` tokens (the one in hand and the one arriving).

Contiguous blocks rather than zigzag: the causal work is uneven (ring rank ``r`` attends to ``r + 1`` blocks, so the last
rank does ``ring`` times the first's), but the layout stays the one every other part of the split already uses; a
zigzag split would permute the row, its positions and every gathered result. The blocks a query block cannot see
(those after it) are skipped, not computed and masked.

The ring (`ring_attention`): each rank computes its query block against the key/value block in hand, passes that block
to the next rank (``torch.distributed.batch_isend_irecv``, overlapped with the compute) and merges the partial outputs
with their log-sum-exp, so the result equals one softmax over the whole row. Sequence boundaries of the packed row come
from the whole row's position ids (a sequence starts at each 0), as in Ulysses; causality from the global token index.
The backward runs the ring again: each rank's dQ stays home, dK/dV travel with their key/value block and arrive back
at their owner after ``ring`` hops. It is exact math in float32 (tests compare it with one rank's autograd); on CUDA
with flash-attn and ring-flash-attn installed, ring-flash-attn's varlen kernel runs instead (`ring_kernel`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from easyrl.distributed.sequence_parallel import RingGroup


__all__ = ["ring_attention", "ring_kernel", "sequence_ids"]


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(T,) the index of the packed sequence each token of a row belongs to, from its positions (1, T) or (T,): a
    sequence starts at each position 0 (the split's padding is such a sequence of its own)."""
    return torch.cumsum(position_ids.reshape(-1) == 0, dim=0)


def ring_kernel(device: torch.device) -> str:
    """Which implementation runs the ring on `device`: ``ring_flash_attn`` on CUDA where flash-attn and
    ring-flash-attn are installed, else ``cpu`` (this module's exact float32 ring). The one place that chooses."""
    if device.type == "cuda" and all(
        importlib.util.find_spec(m) is not None for m in ("flash_attn", "ring_flash_attn")
    ):
        return "ring_flash_attn"
    return "cpu"


def _shift(tensors: list[torch.Tensor], ring: RingGroup) -> tuple[list[torch.Tensor], list[Any]]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's: (buffers, requests,
    and the tensors sent, which must live until the requests are done)."""
    if ring.size == 1:
        return tensors, []
    nxt, prev = ring.ranks[(ring.rank + 1) % ring.size], ring.ranks[(ring.rank - 1) % ring.size]
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, nxt, ring.group) for t in sent]
    ops += [dist.P2POp(dist.irecv, r, prev, ring.group) for r in received]
    return received, [*dist.batch_isend_irecv(ops), sent]


def _wait(requests: list[Any]) -> None:
    for req in requests[:-1]:  # the last entry is the list of tensors sent, kept alive until here
        req.wait()


def _scores(
    q: torch.Tensor, k: torch.Tensor, q_block: int, k_block: int, seq: torch.Tensor, scale: float
) -> torch.Tensor:
    """(H, L, L) scaled scores of query block `q_block` against key block `k_block`, -inf where a query may not look:
    another sequence of the packed row, or a later token."""
    length = q.shape[1]
    qi = torch.arange(length, device=q.device) + q_block * length  # global token index of each query
    ki = torch.arange(length, device=q.device) + k_block * length
    sq, sk = seq[q_block * length : (q_block + 1) * length], seq[k_block * length : (k_block + 1) * length]
    allowed = (sq[:, None] == sk[None, :]) & (ki[None, :] <= qi[:, None])
    return (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """q, k, v (H, L, D) float32, this rank's block of the row -> (H, L, D)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, scale: float, ring: RingGroup
    ) -> torch.Tensor:
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:2], float("-inf"))  # (H, L) log-sum-exp of the scores seen so far
        kv = [k, v]
        for step in range(ring.size):
            block = (ring.rank - step) % ring.size  # the key/value block in hand: it came `step` hops
            pending = _shift(kv, ring) if step < ring.size - 1 else None  # overlapped with this step's compute
            if block <= ring.rank:  # later blocks are all masked (causal): skipped
                s = _scores(q, kv[0], ring.rank, block, seq, scale)
                # Step 0 is the diagonal block, where every query sees itself: `lse` is finite from then on, so the
                # rescaling below never meets -inf - -inf, and a fully masked row of a later block adds exp(-inf) = 0.
                new = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
                out = out * torch.exp(lse - new)[..., None] + torch.exp(s - new[..., None]) @ kv[1]
                lse = new
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        ctx.save_for_backward(q, k, v, seq, out, lse)
        ctx.scale, ctx.ring = scale, ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, seq, out, lse = ctx.saved_tensors
        scale, ring = ctx.scale, ctx.ring
        delta = (dout * out).sum(-1, keepdim=True)  # (H, L, 1): rowsum(dO * O), the softmax backward's correction
        dq = torch.zeros_like(q)
        # the travelling state: a key/value block and the gradients collected for it so far
        travel = [k, v, torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(ring.size):
            block = (ring.rank - step) % ring.size
            kb, vb, dk, dv = travel
            if block <= ring.rank:
                p = torch.exp(_scores(q, kb, ring.rank, block, seq, scale) - lse[..., None])  # the final softmax
                dv = dv + p.transpose(1, 2) @ dout
                ds = p * (dout @ vb.transpose(1, 2) - delta)
                dq = dq + ds @ kb * scale
                dk = dk + ds.transpose(1, 2) @ q * scale
            # The last hop carries only the gradients: it brings each block's dK/dV home to the rank that owns it.
            send = [kb, vb, dk, dv] if step < ring.size - 1 else [dk, dv]
            received, reqs = _shift(send, ring)
            _wait(reqs)
            travel = received if step < ring.size - 1 else [k, v, *received]
        return dq, travel[2], travel[3], None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    scale: float,
    ring: RingGroup,
) -> torch.Tensor:
    """Causal attention of this rank's block of a packed row over the whole row: query (1, Hq, L, D), key/value
    (1, Hkv, L, D) with Hkv dividing Hq, `position_ids` the whole row's (1, ring x L) -> (1, L, Hq, D), the layout
    transformers' attention functions return."""
    if position_ids.numel() != query.shape[2] * ring.size:
        raise RuntimeError(
            f"ring attention: the row's positions ({position_ids.numel()}) are not ring_size={ring.size} blocks of "
            f"{query.shape[2]} tokens"
        )
    if ring_kernel(query.device) == "ring_flash_attn":
        return _flash_ring(query, key, value, position_ids, scale, ring)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: each key/value head serves `groups` consecutive query heads (transformers' repeat_kv)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q, k, v = (t[0].float() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, sequence_ids(position_ids), scale, ring)
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0)


def _flash_ring(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    scale: float,
    ring: RingGroup,
) -> torch.Tensor:
    """ring-flash-attn on CUDA. Its ring varlen function wants every packed sequence split evenly over the ranks; our
    blocks are contiguous cuts of the whole row, which is the layout of its ``llama3`` varlen function (the key/value
    blocks a rank's queries need are gathered over the ring in stripes of heads), so that is the one called."""
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    starts = (position_ids.reshape(-1) == 0).nonzero().reshape(-1)
    total = torch.tensor([position_ids.numel()], device=starts.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, ring.rank, ring.size)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (L, H, D): flash-attn's varlen layout
    out = llama3_flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
        softmax_scale=scale, causal=True, group=ring.group,
    )  # fmt: skip
    return out.unsqueeze(0)  # (1, L, H, D)
