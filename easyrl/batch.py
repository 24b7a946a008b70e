"""The batch that flows between stages: tensors sharing a first dimension, plus per-sample Python objects.

Tensor fields used by the trainer (B samples, P prompt tokens left-padded, R response tokens right-padded):
    prompts (B, P), responses (B, R), input_ids (B, P+R), attention_mask (B, P+R), position_ids (B, P+R),
    response_mask (B, R), loss_mask (B, R), rollout_log_probs (B, R), old_log_probs (B, R), ref_log_probs (B, R), values (B, R),
    token_level_scores (B, R), token_level_rewards (B, R), advantages (B, R), returns (B, R).
`response_mask` is the attention side (which response tokens exist: attention, packing, lengths); `loss_mask` the
training side (which of them the losses, advantages, rewards and metrics count). They are equal for a single-turn
rollout; a multi-turn one zeroes tool output in `loss_mask` only (seen, never trained on).
Non-tensor fields: uid (group id of the prompt), ground_truth, raw_prompt, row, index.
Rows only: settings for a call (sampling, the entropy coefficient) are typed arguments of the worker method, and
what a call measures (timings) comes back as a typed result beside the batch; there is no batch-wide bag.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors whose first dimension is the batch."""
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sample Python objects (lists of length B)."""

    def __post_init__(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        sizes |= {k: len(v) for k, v in self.non_tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for lst in self.non_tensors.values():
            return len(lst)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"batch has no field {key!r}; it has {sorted(self.tensors) + sorted(self.non_tensors)}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def set(self, **fields: Any) -> Batch:
        """Add or replace fields in place (tensors or lists); returns self."""
        for k, v in fields.items():
            if isinstance(v, torch.Tensor):
                self.tensors[k] = v
            else:
                self.non_tensors[k] = list(v)
        self.__post_init__()
        return self

    def select(self, *keys: str) -> Batch:
        """A batch with only these fields."""
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
        )

    def union(self, other: Batch) -> Batch:
        """Fields of both (other wins on a clash); sizes must agree."""
        return Batch({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors})

    def index(self, idx: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at positions `idx`, in that order."""
        ids = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        t = torch.tensor(ids, dtype=torch.long)
        return Batch(
            {k: v[t] for k, v in self.tensors.items()},
            {k: [v[i] for i in ids] for k, v in self.non_tensors.items()},
        )

    def slice(self, start: int, end: int) -> Batch:
        return Batch(
            {k: v[start:end] for k, v in self.tensors.items()},
            {k: v[start:end] for k, v in self.non_tensors.items()},
        )

    def chunk(self, n: int) -> list[Batch]:
        """`n` equal consecutive parts (the size must divide evenly: workers get the same load)."""
        size = len(self)
        if size % n:
            raise ValueError(f"cannot split a batch of {size} into {n} equal parts")
        step = size // n
        return [self.slice(i * step, (i + 1) * step) for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of at most `size` samples."""
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]

    def repeat_interleave(self, n: int) -> Batch:
        """Each sample repeated `n` times in place (a, a, b, b, ...)."""
        ids = [i for i in range(len(self)) for _ in range(n)]
        return self.index(ids)

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors))

    @classmethod
    def concat(cls, parts: Iterable[Batch]) -> Batch:
        """Concatenate along the batch; tensors of different widths are right-padded with zeros first."""
        parts = list(parts)
        if not parts:
            return cls()
        tensors = {}
        for k in parts[0].tensors:
            values = [p.tensors[k] for p in parts]
            if values[0].dim() > 1 and len({v.shape[1:] for v in values}) > 1:
                width = max(v.shape[1] for v in values)
                values = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values]
            tensors[k] = torch.cat(values)
        non_tensors = {k: [x for p in parts for x in p.non_tensors[k]] for k in parts[0].non_tensors}
        return cls(tensors, non_tensors)
