"""Batching prompts: left padding to the longest prompt of the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


__all__ = ["collate_prompts"]

_LIST_KEYS = (
    "raw_prompt",
    "ground_truth",
    "row",
    "index",
    "images",
    "videos",
    "multi_modal_inputs",
    "rollout_prompt",
)


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int, max_prompt_length: int) -> dict[str, Any]:
    """Stack dataset items into a left-padded batch.

    Prompts are padded on the left so every prompt ends at the same column and generation continues right after
    it. The width is the longest prompt of this batch, not ``max_prompt_length``: short batches cost less.

    Args:
        items: dataset items (``prompt_ids`` plus the per-sample fields).
        pad_token_id: token placed in the padding.
        max_prompt_length: upper bound on any prompt; longer ones are an error (the dataset filters them).

    Returns:
        ``input_ids``, ``attention_mask`` and ``position_ids`` as (B, P) int64 tensors, and the lists
        ``raw_prompt``, ``ground_truth``, ``row``, ``index`` (plus ``images`` / ``videos`` when the items have them).
    """
    if not items:
        raise ValueError("collate_prompts: empty batch")
    lengths = [len(item["prompt_ids"]) for item in items]
    width = max(lengths)
    if width > max_prompt_length:
        raise ValueError(f"a prompt has {width} tokens > max_prompt_length={max_prompt_length}")
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (item, length) in enumerate(zip(items, lengths)):
        if length:
            input_ids[row, width - length :] = torch.as_tensor(item["prompt_ids"], dtype=torch.long)
            attention_mask[row, width - length :] = 1
    # Positions count real tokens only; padding gets 0 (it is masked out anyway).
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    for key in _LIST_KEYS:
        if all(key in item for item in items):
            batch[key] = [item[key] for item in items]
    return batch
