"""Ulysses sequence parallelism: the process groups, the sequence split and the two collectives it needs.

The ranks are cut into groups of ``size`` consecutive ranks (rank ``r`` is in group ``r // size``). Every rank of a
group holds the same micro-batch; its packed row (padding-free, one row of all valid tokens) is padded to a multiple
of ``size`` and rank ``i`` of the group keeps tokens ``[i * T / size, (i + 1) * T / size)``. Everything that works
token by token (embeddings, MLPs, norms, rotary embeddings, the log-prob head) runs on the local tokens only. Only
attention needs the whole sequence: there an all-to-all trades the sequence split for a head split (every rank
sees all tokens of ``heads / size`` heads), attention runs, and a second all-to-all trades back
(`easyrl.workers.ulysses`). The per-token results are gathered over the group, so the loss is computed, the same on
every rank of the group, exactly as without the split.

Gradients: each rank of a group holds the whole (replicated) loss. The backward of the gather is the sum over the
group of the ranks' identical gradients, i.e. ``size`` times the local slice; FSDP2 then averages over all ranks
(``dp * size``), which gives the mean over the data-parallel groups, as without sequence parallelism.

The split pads with a short extra "sequence" (positions 0, 1, ...) so padding tokens attend only to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


__all__ = [
    "RingGroup",
    "SPGroup",
    "all_to_all",
    "gather_sequence",
    "init_sequence_parallel",
    "init_sequence_parallel_groups",
    "shard_sequence",
]


@dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group."""

    group: Any
    """The torch.distributed process group of the `size` ranks."""
    size: int
    rank: int
    """This rank's index in the group (which slice of the sequence it holds)."""


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring (ring attention, `easyrl.workers.ring`): the ranks holding the same heads and the row's
    successive blocks."""

    group: Any
    """The torch.distributed process group of the ring's ranks."""
    ranks: tuple[int, ...]
    """Their global ranks, in block order: ``ranks[i]`` holds block ``i`` of the row."""
    rank: int
    """This rank's index in `ranks` (which block of the row it holds)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def init_sequence_parallel(size: int) -> SPGroup:
    """Create the groups of `size` consecutive ranks (a collective: every rank calls it, in the same order) and
    return this rank's. The caller keeps it (`easyrl.workers.ulysses.SequenceParallel`): no module-level registry,
    so two models of one process can hold groups of their own."""
    if not dist.is_initialized():
        raise RuntimeError(f"sequence parallelism (ulysses_size={size}) needs an initialized process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"ulysses_size={size} must divide the number of workers ({world})")
    mine = None
    # Every rank creates every group, in the same order: `new_group` is a collective over all ranks, even for the
    # groups a rank is not in.
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return SPGroup(mine, size, rank % size)  # rank r is index r % size of group r // size


def init_sequence_parallel_groups(ulysses: int, ring: int) -> tuple[SPGroup, SPGroup, RingGroup | None]:
    """The groups of Ulysses composed with ring attention (a collective: every rank calls it, in the same order):
    (the whole sequence-parallel group of ``ulysses x ring`` consecutive ranks, this rank's Ulysses sub-group, its ring
    or None when ``ring`` is 1). Group rank ``s`` is Ulysses index ``s % ulysses`` of ring index ``s // ulysses``: the
    Ulysses sub-groups are runs of consecutive ranks (their all-to-all gathers one contiguous block of the row), a ring
    joins the ranks of one Ulysses index (layout: `easyrl.workers.ring`)."""
    if ring == 1:
        whole = init_sequence_parallel(ulysses)
        return whole, whole, None
    size = ulysses * ring
    if dist.is_initialized() and dist.get_world_size() % size:
        raise ValueError(
            f"ulysses_size x ring_size = {ulysses} x {ring} must divide the number of workers ({dist.get_world_size()})"
        )
    whole = init_sequence_parallel(size)
    base = dist.get_rank() - whole.rank  # the global rank of this group's index 0
    mine: dict[str, Any] = {}
    # Every rank creates every sub-group of every group, in the same order (`new_group` is a collective over all).
    for start in range(0, dist.get_world_size(), size):
        for r in range(ring):
            ranks = [start + r * ulysses + u for u in range(ulysses)]
            group = dist.new_group(ranks)
            if start == base and r == whole.rank // ulysses:
                mine["ulysses"] = group
        for u in range(ulysses):
            ranks = [start + r * ulysses + u for r in range(ring)]
            group = dist.new_group(ranks)
            if start == base and u == whole.rank % ulysses:
                mine["ring"] = RingGroup(group, tuple(ranks), whole.rank // ulysses)
    return whole, SPGroup(mine["ulysses"], ulysses, whole.rank % ulysses), mine["ring"]


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SPGroup) -> torch.Tensor:
    # all_to_all takes contiguous tensors; chunks along an inner dim are strided views
    chunks = [c.contiguous() for c in x.chunk(sp.size, dim=scatter_dim)]
    received = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(received, chunks, group=sp.group)
    return torch.cat(received, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dims, ctx.sp = (scatter_dim, gather_dim), sp
        return _exchange(x, scatter_dim, gather_dim, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
        return _exchange(grad, gather_dim, scatter_dim, ctx.sp), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SPGroup) -> torch.Tensor:
    """Split `x` in `sp.size` chunks along `scatter_dim`, send chunk j to group rank j, and concatenate what each
    rank sent along `gather_dim` (in rank order). Differentiable: the backward is the reverse exchange."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, sp)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, sp: SPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.sp = dim, sp
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Every rank of the group computes the same loss from the gathered tensor, so the sum over the group of the
        # ranks' gradients (the true backward of an all-gather, a reduce-scatter) is `size` times this rank's slice.
        local = grad.chunk(ctx.sp.size, dim=ctx.dim)[ctx.sp.rank]
        return local * ctx.sp.size, None, None


def gather_sequence(x: torch.Tensor, dim: int, sp: SPGroup) -> torch.Tensor:
    """Concatenate the group's local slices along `dim` (the whole sequence on every rank), differentiably."""
    return _GatherSequence.apply(x, dim, sp)


def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of `size`."""
    return -(-length // size) * size  # ceil division


def _pad(x: torch.Tensor, dim: int, pad: int, positions: bool) -> torch.Tensor:
    """`x` with `pad` entries appended along `dim`: zeros, or for position ids 0, 1, ... (a sequence of its own)."""
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    if positions:
        # Positions 0, 1, ...: the packed attention starts a sequence at each 0, so the padding attends only to itself.
        fill = torch.arange(pad, device=x.device, dtype=x.dtype)
        view = [1] * x.dim()
        view[dim] = pad
        tail = fill.view(view).expand(shape)  # broadcast over the other dims (the rows of M-RoPE positions)
    else:
        tail = x.new_zeros(shape)
    return torch.cat([x, tail], dim=dim)


def shard_sequence(
    sp: SPGroup, seq_dims: dict[str, tuple[torch.Tensor, int]], position_keys: tuple[str, ...] = ("position_ids",)
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Pad each tensor's sequence dimension to a multiple of the group size and keep this rank's slice.

    `seq_dims`: name -> (tensor, its sequence dim), all with the same sequence length T: `input_ids` (1, T),
    `inputs_embeds` (1, T, H) with vision embeddings already scattered in, `position_ids` (1, T) or multimodal
    RoPE ids (3, 1, T). Tensors named in `position_keys` are padded with 0, 1, ... (the padding is a sequence of
    its own), the others with zeros. Returns (this rank's slices, the whole padded tensors); attention needs the
    whole padded 1-D positions of the row (`easyrl.workers.ulysses.SequenceParallel.position_ids`).
    """
    lengths = {t.shape[d] for t, d in seq_dims.values()}
    if len(lengths) != 1:
        raise ValueError(f"shard_sequence: the tensors disagree on the sequence length: {sorted(lengths)}")
    length = lengths.pop()
    total = padded_length(length, sp.size)
    local_len = total // sp.size
    full = {k: _pad(t, d, total - length, k in position_keys) for k, (t, d) in seq_dims.items()}
    local = {k: full[k].narrow(seq_dims[k][1], sp.rank * local_len, local_len) for k in full}  # views, no copy
    return local, full
