"""An epoch-aware prompt sampler whose whole state is three integers, so resuming is exact.

The order of epoch ``e`` is a pure function of ``(seed, e)``: resuming needs only the epoch and the position inside
its permutation, not a pickled random generator.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np


__all__ = ["PromptSampler"]

logger = logging.getLogger(__name__)


class PromptSampler:
    """Yields batches of dataset indices, epoch after epoch.

    Args:
        dataset_len: number of prompts.
        batch_size: prompts per batch; every batch is full.
        shuffle: permute each epoch (else every epoch is ``0..dataset_len-1``).
        seed: seed of the permutations.
        drop_last: the tail of an epoch that cannot fill a batch is skipped and the batch is taken from the next
            epoch. With ``False`` the tail is kept and the batch is completed with the first indices of the next
            epoch's order (so no prompt is skipped, and the batch is still full).
    """

    def __init__(self, dataset_len: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True) -> None:
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, got {dataset_len}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > dataset_len:
            raise ValueError(
                f"batch size {batch_size} is larger than the dataset ({dataset_len} prompts) with drop_last=True"
            )
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0  # next index to take within the current epoch's order
        self._steps = 0  # batches handed out since the start
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (0-based)."""
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (with ``drop_last=False`` batches straddle epochs, so this is the rounded-up count)."""
        if self.drop_last:
            return self.dataset_len // self.batch_size
        return math.ceil(self.dataset_len / self.batch_size)

    @property
    def steps(self) -> int:
        """Batches handed out so far (resumed with the state)."""
        return self._steps

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``; depends only on ``(seed, epoch)``."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            # SeedSequence mixes both numbers, so nearby seeds/epochs give unrelated orders; it needs non-negatives.
            rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch])
            order = rng.permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len)
        self._order_cache = (epoch, order)
        return order

    def next_indices(self) -> list[int]:
        """The next full batch of indices, starting the next epoch when the current one is used up."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            remaining = self.dataset_len - self._position
            need = self.batch_size - len(batch)
            if remaining <= 0 or (self.drop_last and not batch and remaining < need):
                self._epoch += 1
                self._position = 0
                continue
            take = min(need, remaining)
            order = self.order(self._epoch)
            batch.extend(int(i) for i in order[self._position : self._position + take])
            self._position += take
        if self._position >= self.dataset_len or (
            self.drop_last and self.dataset_len - self._position < self.batch_size
        ):
            # Roll over eagerly so `epoch` already names the epoch the next batch comes from.
            self._epoch += 1
            self._position = 0
        self._steps += 1
        return batch

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        return self.next_indices()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state (plain ints and bools)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "steps": self._steps,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the data order matches exactly when the dataset and settings are unchanged."""
        changed = [
            key
            for key in ("seed", "dataset_len", "batch_size", "shuffle", "drop_last")
            if key in state and state[key] != getattr(self, key)
        ]
        if changed:
            # A changed dataset or batch size cannot be resumed exactly; continuing beats refusing to resume.
            logger.warning(
                "resuming the prompt sampler with changed %s: the data order will differ from the original run",
                ", ".join(f"{k} ({state[k]} -> {getattr(self, k)})" for k in changed),
            )
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._steps = int(state.get("steps", 0))
        if self._position >= self.dataset_len:
            self._epoch += 1
            self._position = 0
