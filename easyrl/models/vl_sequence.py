"""The sequence-parallel seam of vision-language models: split the language model's inputs after the vision tower.

A VL forward on a packed row is: token embeddings of the whole row, the vision tower on the row's patches, its
output scattered into the image/video slots, then the decoder layers. Under sequence parallelism the split belongs
between the last two steps, so :func:`split_after_embeddings` hooks the language model's entry (a forward pre-hook on
``model.language_model``, the Qwen2.5-VL / Qwen3-VL text model; an Omni thinker's ``model``) and hands it this
rank's slice of

* ``inputs_embeds`` (1, T, H), vision embeddings already in place,
* ``position_ids`` (4, 1, T) (text row, then M-RoPE rows: each position stays with its token),
* Qwen3-VL's deepstack inputs: ``visual_pos_masks`` (1, T) and the per-layer ``deepstack_visual_embeds``, whose rows
  (one per visual token of the whole row) are cut down to the visual tokens of the slice.

Every rank of a sequence-parallel group embeds the whole micro-batch (never per slice, so an image cut by a slice
boundary is still encoded whole) rather than one rank encoding and broadcasting: the tower's FSDP units are sharded
over every rank, so every rank joins their all-gathers anyway. The tower's own work is split, though: each rank
encodes a share of the frames and one all-gather gives every rank the whole output (`easyrl.models.vl_embeds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


__all__ = ["SliceFn", "language_model", "split_after_embeddings"]

SliceFn = Callable[[dict[str, tuple[torch.Tensor, int]]], dict[str, torch.Tensor]]
"""name -> (whole-row tensor, its sequence dim) to name -> this rank's slice; every tensor is cut at the same token
positions (e.g. the first result of ``easyrl.distributed.sequence_parallel.shard_sequence``). Tensors named
``position_ids`` may be padded as positions, the others must be padded with zeros."""


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder of a VL model (``*ForConditionalGeneration``, its backbone, or the VL critic), or of an Omni
    thinker (or its critic): the thinker has no backbone, its text model is its ``model``, beside its audio tower."""
    for owner in (model, getattr(model, "model", None)):
        lm = getattr(owner, "language_model", None)
        if isinstance(lm, nn.Module):
            return lm
        text = getattr(owner, "model", None)
        if isinstance(getattr(owner, "audio_tower", None), nn.Module) and isinstance(text, nn.Module):
            return text
    raise ValueError(f"{type(model).__name__} has no language_model: not a Qwen-VL style vision-language model")


def _slice_inputs(kwargs: dict[str, Any], slice_fn: SliceFn) -> dict[str, Any]:
    """The language model's keyword arguments with the sequence tensors replaced by this rank's slices."""
    embeds, pos = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
    if (
        embeds is None
        or pos is None
        or embeds.shape[0] != 1
        or pos.dim() != 3
        or kwargs.get("attention_mask") is not None
    ):
        raise RuntimeError(
            "split_after_embeddings takes one packed row: inputs_embeds (1, T, H), position_ids (4, 1, T), no mask"
        )
    seq: dict[str, tuple[torch.Tensor, int]] = {"inputs_embeds": (embeds, 1), "position_ids": (pos, 2)}
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL deepstack: which deepstack rows (one per visual token) each token owns
        seq["visual_pos_masks"] = (visual, 1)
        seq["visual_rows"] = ((visual.long().cumsum(1) - 1) * visual, 1)
    local = slice_fn(seq)
    out = dict(kwargs, inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
    if visual is not None:
        mask = local["visual_pos_masks"].bool()
        rows = local["visual_rows"][mask]
        out["visual_pos_masks"] = mask
        out["deepstack_visual_embeds"] = [e.index_select(0, rows) for e in kwargs["deepstack_visual_embeds"]]
    return out


@contextmanager
def split_after_embeddings(model: nn.Module, slice_fn: SliceFn) -> Iterator[None]:
    """While active, `model`'s language model runs on this rank's slice of the packed row (see the module doc):
    its hidden states, hence the logits or values, cover the slice's tokens only."""
    lm = language_model(model)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        if args:
            raise RuntimeError(f"{type(module).__name__} was called with positional inputs; expected keywords")
        return args, _slice_inputs(kwargs, slice_fn)

    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
