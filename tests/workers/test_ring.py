"""Ring attention equals one rank's causal packed attention: outputs and the gradients of query, key and value, on gloo
rings of 2 and 4 ranks, for a packed row whose sequences cross block boundaries (GQA: 4 query heads, 2 key/value)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.workers.test_batching import close_rank, init_rank, run_ranks


LENGTHS = (5, 11, 1, 7)  # 24 tokens: 12 per block on a ring of 2, 6 on a ring of 4; sequences straddle the cuts
HEADS, KV_HEADS, DIM = 4, 2, 8


def _row() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(1, HEADS, total, DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, total, DIM, generator=gen) for _ in range(2))
    dout = torch.randn(1, total, HEADS, DIM, generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return q, k, v, dout, positions


def _one_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sequence by sequence causal sdpa and its autograd: the output and dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    parts, start = [], 0
    for n in LENGTHS:
        cut = slice(start, start + n)
        parts.append(
            F.scaled_dot_product_attention(q[:, :, cut], k[:, :, cut], v[:, :, cut], is_causal=True, enable_gqa=True)
        )
        start += n
    out = torch.cat(parts, dim=2).transpose(1, 2)  # (1, T, H, D)
    out.backward(dout)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from easyrl.distributed.sequence_parallel import RingGroup
    from easyrl.workers.ring import ring_attention

    init_rank(rank, world)
    q, k, v, dout, positions = _row()
    want = _one_rank(q, k, v, dout)
    failures: list[str] = []
    # a ring of all ranks, and (with 4) rings of 2: ranks {0, 2} and {1, 3}, as the Ulysses x ring layout makes them
    sizes = (world, 2) if world == 4 else (world,)
    for size in sizes:
        ranks = tuple(range(world)) if size == world else tuple(range(rank % 2, world, 2))
        groups = (
            [dist.new_group(list(range(world)))] if size == world else [dist.new_group([0, 2]), dist.new_group([1, 3])]
        )
        ring = RingGroup(groups[0] if size == world else groups[rank % 2], ranks, ranks.index(rank))
        block = q.shape[2] // size
        cut = slice(ring.rank * block, (ring.rank + 1) * block)
        ql, kl, vl = (t[:, :, cut].clone().requires_grad_() for t in (q, k, v))
        got = ring_attention(ql, kl, vl, positions, DIM**-0.5, ring)
        got.backward(dout[:, cut])
        checks = {
            "out": (got.detach(), want["out"][:, cut]),
            "dq": (ql.grad, want["dq"][:, :, cut]),
            "dk": (kl.grad, want["dk"][:, :, cut]),
            "dv": (vl.grad, want["dv"][:, :, cut]),
        }
        for name, (a, b) in checks.items():
            try:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            except AssertionError as exc:
                failures.append(f"ring {size} rank {rank} {name}: {str(exc).splitlines()[:3]}")
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, failures)
    if rank == 0:
        Path(out).write_text(json.dumps([f for part in gathered for f in part or []]))
    close_rank()


def test_ring_attention_equals_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "failures.json"
    run_ranks(_worker, 4, str(out))
    assert json.loads(out.read_text()) == []
