"""Forward passes under Ulysses sequence parallelism (`ulysses_size` > 1), and the attention that makes them exact.

The group and collectives are in `easyrl.distributed.sequence_parallel`. Here:

* `ulysses_attention_forward`, registered as the attention implementation ``easyrl_ulysses``: query/key/value of
  the local tokens and all heads go through an all-to-all to all tokens of ``heads / size`` heads, the packed
  attention the model would use without sequence parallelism (``easyrl_varlen`` or ``flash_attention_2``, the
  *inner* implementation) runs on them with the whole row's position ids (its sequence boundaries), and a second
  all-to-all brings the output back to the local tokens and all heads. With fewer key/value heads than ranks
  (GQA), each key/value head is repeated so that every rank gets the one its query heads share. With `ring_size`
  > 1 the all-to-alls run within each Ulysses sub-group, which then holds one contiguous block of the row, and ring
  attention across the ring replaces the inner call (`easyrl.workers.ring`, where the layout is described).
* `split_forward`: a layout transform around the one forward head (`easyrl.workers.head`): the packed row split
  over the group, the head run on the local tokens, its per-token results gathered back, so callers get the same
  (N,) selections as without the split.

The group rides on an object, `SequenceParallel`, made once per model (`enable_sequence_parallel`) and attached to
the model's modules: transformers hands the attention function the attention layer itself, which is how the
attention finds its group and the current pass's whole-row positions. No module-level state.

Vision-language rows are not split before the model: the model gets the whole packed row (ids, media, 4-row
positions), embeds it and runs its vision tower on every rank of the group, and its language model receives this
rank's slice of the embeddings and positions (`easyrl.models.vl_sequence.split_after_embeddings`, cut by
`shard_sequence` exactly as text rows are), so the results are picked and gathered the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from easyrl.distributed.sequence_parallel import (
    RingGroup,
    SPGroup,
    all_to_all,
    gather_sequence,
    init_sequence_parallel_groups,
    shard_sequence,
)
from easyrl.models.vl_sequence import split_after_embeddings
from easyrl.workers.packing import ModelInputs
from easyrl.workers.ring import ring_attention


__all__ = [
    "ULYSSES_ATTENTION",
    "SequenceParallel",
    "enable_sequence_parallel",
    "gather_selected",
    "local_selection",
    "register_ulysses_attention",
    "sequence_parallel_of",
    "split_forward",
]

ULYSSES_ATTENTION = "easyrl_ulysses"
"""The ``attn_implementation`` models are loaded with when `ulysses_size` > 1."""

_ATTRIBUTE = "easyrl_sequence_parallel"
"""Where `SequenceParallel.attach` puts the object on each module of a model."""

Head = Callable[[ModelInputs], tuple[torch.Tensor, torch.Tensor | None]]
"""A forward head: a layout -> (N,) results at its selected positions, and (N,) entropy or None."""


class SequenceParallel:
    """One model's sequence-parallel group, the packed attention it wraps, and the pass under way."""

    attn_implementation = ULYSSES_ATTENTION

    def __init__(
        self, group: SPGroup, inner: str, ulysses: SPGroup | None = None, ring: RingGroup | None = None
    ) -> None:
        self.group = group
        """The whole sequence-parallel group (``ulysses x ring`` ranks): the row is split and gathered over it."""
        self.inner = inner
        """The registered packed attention run on all tokens of `heads / size` heads (``easyrl_varlen``, ...)."""
        self.ulysses = group if ulysses is None else ulysses
        """The ranks that exchange heads for tokens (all of `group` without a ring)."""
        self.ring = ring
        """The ring that replaces the inner attention, or None."""
        self.position_ids: torch.Tensor | None = None
        """The whole padded row's 1-D positions (1, T) of the last pass. Kept after the pass: with gradient
        checkpointing, its backward runs the layers' forwards, attention included, again."""

    def attach(self, model: nn.Module) -> None:
        """Make the attention layers of `model` find this object (every module gets it: whichever the model
        calls its attention from)."""
        for module in model.modules():
            setattr(module, _ATTRIBUTE, self)


def sequence_parallel_of(model: nn.Module) -> SequenceParallel | None:
    """The object `enable_sequence_parallel` attached to `model`, or None."""
    sp = getattr(model, _ATTRIBUTE, None)
    return sp if isinstance(sp, SequenceParallel) else None


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface on local tokens: query (1, Hq, L, D), key/value (1, Hkv, L, D) ->
    (1, L, Hq, D), attending over the whole row of the group."""

    state = sequence_parallel_of(module)
    if state is None or state.position_ids is None:
        raise RuntimeError(
            f"{ULYSSES_ATTENTION} attention runs only inside `split_forward` on a model given its group by "
            "SequenceParallel.attach (sequence parallelism)"
        )
    sp = state.ulysses
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp.size:
        raise RuntimeError(f"ulysses_size={sp.size} must divide the attention heads ({heads})")
    if sp.size == 1:  # ring attention alone: every rank keeps all heads of its block
        return _attend(state, module, query, key, value, attention_mask, kwargs), None
    # lcm: the fewest copies per key/value head that split evenly over the ranks. repeat_interleave keeps each copy
    # next to its original, so every rank's slice of key/value heads still lines up with its slice of query heads.
    repeat = math.lcm(kv_heads, sp.size) // kv_heads
    if repeat > 1:  # GQA with fewer KV heads than ranks: each rank needs the KV head its query heads share
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # sequence-split, all heads -> whole sequence, heads / size (dims: 1 = heads, 2 = tokens)
    # The tokens arrive in rank order, which is row order: rank i holds the i-th slice of the row.
    q, k, v = (all_to_all(t, 1, 2, sp) for t in (query, key, value))
    out = _attend(state, module, q, k, v, attention_mask, kwargs)  # (1, T / ring, H / size, D)
    # The output has tokens on dim 1, heads on dim 2: the reverse exchange returns the tokens and gathers the heads.
    return all_to_all(out, 1, 2, sp), None


def _attend(
    state: SequenceParallel,
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Attention of the tokens after the Ulysses exchange (1, H, L, D) over the whole row -> (1, L, H, D): the inner
    packed attention (L = the row), or the ring (L = this rank's block of the row)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert state.position_ids is not None  # checked by the caller
    if state.ring is None:
        kwargs["position_ids"] = state.position_ids  # the whole row's: where the packed attention cuts the sequences
        return ALL_ATTENTION_FUNCTIONS[state.inner](module, q, k, v, attention_mask, **kwargs)[0]
    if kwargs.get("sliding_window") is not None or kwargs.get("dropout") or kwargs.get("softcap") is not None:
        raise RuntimeError(
            f"ring attention (ring_size={state.ring.size}) does not do sliding windows, attention dropout or softcaps; "
            "set worker.actor.ring_size=1"
        )
    scale = kwargs.get("scaling")
    return ring_attention(q, k, v, state.position_ids, q.shape[-1] ** -0.5 if scale is None else scale, state.ring)


def register_ulysses_attention() -> str:
    """Make ``attn_implementation="easyrl_ulysses"`` loadable in this process; returns the name. The function is
    stateless: each model's group and inner attention come with its `SequenceParallel`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    return ULYSSES_ATTENTION


def enable_sequence_parallel(size: int, inner: str | None, ring: int = 1) -> SequenceParallel:
    """Create this process's sequence-parallel groups, Ulysses of `size` composed with a ring of `ring` (a collective
    over all ranks) and register the attention around the packed attention `inner`. Load the model with the result's
    `attn_implementation`, then `attach` it to the model."""
    if inner is None:
        raise ValueError(
            f"ulysses_size={size}, ring_size={ring} needs padding-free packed rows (worker.actor.padding_free=true)"
        )
    whole, ulysses, ring_group = init_sequence_parallel_groups(size, ring)
    register_ulysses_attention()
    return SequenceParallel(whole, inner, ulysses, ring_group)


def local_selection(select: torch.Tensor, local_len: int, sp: SPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the row positions `select` (N,), those held by this rank: (their index among the local tokens, their index
    in `select`)."""
    start = sp.rank * local_len  # rank i holds the row's tokens [i * local_len, (i + 1) * local_len)
    mine = ((select >= start) & (select < start + local_len)).nonzero().squeeze(1)
    return select.index_select(0, mine) - start, mine


def gather_selected(
    values: torch.Tensor, local_pos: torch.Tensor, local_len: int, select: torch.Tensor, sp: SPGroup
) -> torch.Tensor:
    """This rank's per-token `values` (n,) at local positions `local_pos` -> the group's values at every row
    position of `select` (N,), on every rank (differentiable)."""
    # This rank's slice of the padded row (zeros where nothing is selected). Gathered, it is the whole padded row,
    # which `select` indexes like the unpadded one: the padding is appended at the end.
    row = values.new_zeros(local_len).index_copy(0, local_pos, values)
    return gather_sequence(row, 0, sp).index_select(0, select)


def _shard(inputs: ModelInputs, sp: SPGroup) -> tuple[ModelInputs, int, torch.Tensor, torch.Tensor]:
    """This rank's layout of the packed row `inputs`: the ids and positions to call the model with (local ones; a
    VL model's whole row, cut after its embeddings), `select` the local positions it holds, and their labels; with
    the local length and the whole padded row's 1-D positions."""
    if inputs.media:  # VL: the language model takes its slice after the embeddings (`split_forward`)
        # Only the (4, 1, T) positions are cut here (sequence dim 2), for the local length and the whole padded row;
        # the ids and the media stay whole.
        full = shard_sequence(sp, {"position_ids": (inputs.position_ids, 2)})[1]["position_ids"]
        local_len = full.shape[2] // sp.size
        ids, positions, full_row = inputs.input_ids, inputs.position_ids, full[0]  # full[0]: the 1D text positions
    else:
        local, whole = shard_sequence(
            sp, {"input_ids": (inputs.input_ids, 1), "position_ids": (inputs.position_ids, 1)}
        )
        local_len = local["input_ids"].shape[1]
        ids, positions, full_row = local["input_ids"], local["position_ids"], whole["position_ids"]
    pos, idx = local_selection(inputs.select, local_len, sp)
    labels = inputs.labels.index_select(0, idx)
    # `dest` is unused: the local results are gathered into the whole selection, never scattered from here.
    return ModelInputs(ids, positions, None, pos, labels, pos, inputs.grid, inputs.media), local_len, pos, full_row


def split_forward(
    sp: SequenceParallel, model: nn.Module, inputs: ModelInputs, head: Head
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head` on the packed row `inputs` split over the group: shard the row, run the head on this rank's tokens
    (attention over the whole row), gather the selected results: (N,) each, on every rank, as without the split."""
    local, local_len, pos, full_row = _shard(inputs, sp.group)
    sp.position_ids = full_row  # read by every attention layer of this pass (and its recompute)
    if inputs.media:
        # VL: the whole row goes in (the vision tower needs every image); the language model gets this rank's slice of
        # the embeddings.
        with split_after_embeddings(model, lambda seq: shard_sequence(sp.group, seq)[0]):
            out, ent = head(local)
    else:
        out, ent = head(local)
    gathered = gather_selected(out, pos, local_len, inputs.select, sp.group)
    return gathered, (None if ent is None else gather_selected(ent, pos, local_len, inputs.select, sp.group))
