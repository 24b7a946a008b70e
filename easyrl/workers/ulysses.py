"""Forward passes under Ulysses sequence parallelism (`ulysses_size` > 1), and the attention that makes them exact.

The group and collectives are in `easyrl.distributed.sequence_parallel`. Here:

* `ulysses_attention_forward`, registered as the attention implementation ``easyrl_ulysses``: query/key/value of
  the local tokens and all heads go through an all-to-all to all tokens of ``heads / size`` heads, the packed
  attention the model would use without sequence parallelism (``easyrl_varlen`` or ``flash_attention_2``, the
  *inner* implementation) runs on them with the whole row's position ids (its sequence boundaries), and a second
  all-to-all brings the output back to the local tokens and all heads. With fewer key/value heads than ranks
  (GQA), each key/value head is repeated so that every rank gets the one its query heads share. Ring attention
  would replace the inner call (see docs/architecture.md).
* `sp_token_log_probs` / `sp_response_values`: the packed micro-batch split over the group, the model run on the
  local tokens, the per-token results gathered back, so callers get the same (b, R) grids as without the split.

Vision-language rows are not split before the model: the model gets the whole packed row (ids, media, 4-row
positions), embeds it and runs its vision tower on every rank of the group, and its language model receives this
rank's slice of the embeddings and positions (`easyrl.workers.vl_sequence.split_after_embeddings`, cut by
`shard_sequence` exactly as text rows are), so the results are picked and gathered the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from easyrl.algorithms import entropy_from_logits, logprobs_from_logits
from easyrl.batch import Batch
from easyrl.distributed.sequence_parallel import (
    SPGroup,
    all_to_all,
    gather_sequence,
    init_sequence_parallel,
    shard_sequence,
    sp_group,
)
from easyrl.workers.packing import ModelInputs, fused_forward, prepare_inputs
from easyrl.workers.specs import ForwardOptions
from easyrl.workers.vl_sequence import split_after_embeddings


__all__ = [
    "ULYSSES_ATTENTION",
    "enable_sequence_parallel",
    "gather_selected",
    "local_selection",
    "register_ulysses_attention",
    "sp_response_values",
    "sp_token_log_probs",
    "ulysses_context",
]

ULYSSES_ATTENTION = "easyrl_ulysses"
"""The ``attn_implementation`` models are loaded with when `ulysses_size` > 1."""

_state: dict[str, Any] = {}
"""The inner implementation's name (set at registration); the group and whole-row positions of the pass under way."""


@contextmanager
def ulysses_context(sp: SPGroup, position_ids: torch.Tensor) -> Iterator[None]:
    """Run a forward pass on local tokens: attention gets the group and the whole padded row's 1-D positions
    (1, T) (from which the packed attention cuts the sequences).

    They stay set after the block, until the next pass replaces them: with gradient checkpointing, the backward
    of this pass runs the layers' forwards again, attention included."""
    _state.update(sp=sp, position_ids=position_ids)
    yield


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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if "sp" not in _state:
        raise RuntimeError(f"{ULYSSES_ATTENTION} attention runs only inside ulysses_context (sequence parallelism)")
    sp: SPGroup = _state["sp"]
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp.size:
        raise RuntimeError(f"ulysses_size={sp.size} must divide the attention heads ({heads})")
    repeat = math.lcm(kv_heads, sp.size) // kv_heads
    if repeat > 1:  # GQA with fewer KV heads than ranks: each rank needs the KV head its query heads share
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # sequence-split, all heads -> whole sequence, heads / size (dims: 1 = heads, 2 = tokens)
    q, k, v = (all_to_all(t, 1, 2, sp) for t in (query, key, value))
    kwargs["position_ids"] = _state["position_ids"]
    inner = ALL_ATTENTION_FUNCTIONS[_state["inner"]]
    out, _ = inner(module, q, k, v, attention_mask, **kwargs)  # (1, T, H / size, D)
    return all_to_all(out, 1, 2, sp), None


def register_ulysses_attention(inner: str) -> str:
    """Make ``attn_implementation="easyrl_ulysses"`` loadable in this process around the packed attention `inner`
    (a registered name, e.g. ``easyrl_varlen``); returns the name."""
    from transformers import AttentionInterface

    _state["inner"] = inner
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    return ULYSSES_ATTENTION


def enable_sequence_parallel(size: int, inner: str | None) -> str:
    """Create this process's sequence-parallel groups (a collective over all ranks) and register the attention
    around the packed attention `inner`; returns the implementation name to load the model with."""
    if inner is None:
        raise ValueError(f"ulysses_size={size} needs padding-free packed rows (worker.actor.padding_free=true)")
    init_sequence_parallel(size)
    return register_ulysses_attention(inner)


def local_selection(select: torch.Tensor, local_len: int, sp: SPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the row positions `select` (N,), those held by this rank: (their index among the local tokens, their index
    in `select`)."""
    start = sp.rank * local_len
    mine = ((select >= start) & (select < start + local_len)).nonzero().squeeze(1)
    return select.index_select(0, mine) - start, mine


def gather_selected(
    values: torch.Tensor, local_pos: torch.Tensor, local_len: int, select: torch.Tensor, sp: SPGroup
) -> torch.Tensor:
    """This rank's per-token `values` (n,) at local positions `local_pos` -> the group's values at every row
    position of `select` (N,), on every rank (differentiable)."""
    row = values.new_zeros(local_len).index_copy(0, local_pos, values)
    return gather_sequence(row, 0, sp).index_select(0, select)


def _split(
    model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions
) -> tuple[ModelInputs, SPGroup, dict[str, Any]]:
    """The packed micro-batch, the group, and this rank's share: the ids and positions to call the model with
    (local ones; a VL model's whole row), the whole row's 1-D positions, and which selected positions are local."""
    sp = sp_group(opts.ulysses_size)
    inputs = prepare_inputs(mb, padding_free=True, model=model).to(device)
    share: dict[str, Any]
    if inputs.media:  # VL: the language model takes its slice after the embeddings (`_sp_forward`)
        full = shard_sequence(sp, {"position_ids": (inputs.position_ids, 2)})[1]["position_ids"]
        local_len = full.shape[2] // sp.size
        share = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "full_position_ids": full[0]}
    else:
        local, full_row = shard_sequence(
            sp, {"input_ids": (inputs.input_ids, 1), "position_ids": (inputs.position_ids, 1)}
        )
        local_len = local["input_ids"].shape[1]
        share = {**local, "full_position_ids": full_row["position_ids"]}
    pos, idx = local_selection(inputs.select, local_len, sp)
    share |= {"local_len": local_len, "pos": pos, "idx": idx}
    return inputs, sp, share


@contextmanager
def _sp_forward(model: nn.Module, sp: SPGroup, inputs: ModelInputs, share: dict[str, Any]) -> Iterator[None]:
    """Forward passes on this rank's slice: attention over the group, and for VL rows the split after the
    embeddings."""
    with ulysses_context(sp, share["full_position_ids"]):
        if not inputs.media:
            yield
            return
        with split_after_embeddings(model, lambda seq: shard_sequence(sp, seq)[0]):
            yield


def sp_token_log_probs(
    model: nn.Module, mb: Batch, device: torch.device, temperature: float, with_entropy: bool, opts: ForwardOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_log_probs` with the packed row split over the sequence-parallel group: (b, R) each, on every rank."""
    inputs, sp, share = _split(model, mb, device, opts)
    pos, labels = share["pos"], inputs.labels.index_select(0, share["idx"])
    ent: torch.Tensor | None
    with _sp_forward(model, sp, inputs, share):
        if opts.fused:
            local = ModelInputs(
                share["input_ids"], share["position_ids"], None, pos, labels, pos, inputs.grid, inputs.media
            )
            lp, ent = fused_forward(model, local, temperature, opts.chunk_size)
        else:
            out = model(
                input_ids=share["input_ids"],
                position_ids=share["position_ids"],
                use_cache=False,
                logits_to_keep=pos,
                **inputs.media,
            )
            logits = out.logits[0].float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            lp = logprobs_from_logits(logits, labels)
            ent = entropy_from_logits(logits) if with_entropy else None
    lp = inputs.scatter(gather_selected(lp, pos, share["local_len"], inputs.select, sp))
    if not with_entropy or ent is None:
        return lp, None
    return lp, inputs.scatter(gather_selected(ent, pos, share["local_len"], inputs.select, sp))


def sp_response_values(model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions) -> torch.Tensor:
    """`response_values` with the packed row split over the sequence-parallel group: (b, R), zeros at padding."""
    inputs, sp, share = _split(model, mb, device, opts)
    with _sp_forward(model, sp, inputs, share):
        out = model(input_ids=share["input_ids"], position_ids=share["position_ids"], use_cache=False, **inputs.media)
    values = out.logits[0, :, 0].float().index_select(0, share["pos"])
    values = inputs.scatter(gather_selected(values, share["pos"], share["local_len"], inputs.select, sp))
    return values * mb["response_mask"].to(device)
