"""Every sampling seed of a run, derived by one function from its parent.

The seeds form a tree: the run's `worker.rollout.seed` -> one generate call (a training attempt, a greedy
baseline, a validation chunk) -> one rollout engine -> one sampled row. Each level multiplies its parent by a
stride and adds the child's index, so two children of one parent never share a seed while the index stays below
the stride, and a resumed run re-derives the very same seeds. The strides are the numbers the seeds have always been
made with: changing one changes every sampled token of a run (the golden-trajectory test would catch it).
"""

from __future__ import annotations

from typing import Literal


SeedLevel = Literal["attempt", "call", "engine", "row"]

STRIDES: dict[SeedLevel, int] = {
    "attempt": 1000,  # a step (or a stream) -> its generation attempts (online filtering makes < 1000 per step)
    "call": 100_003,  # rollout.seed -> a generate call's seed (a prime: calls of nearby runs do not collide)
    "engine": 1000,  # a call -> each rollout engine (fewer than 1000 engines)
    "row": 100_003,  # an engine's call -> each sampled row of its share of the batch
}

GREEDY_STREAM = 0
"""Parent of the greedy-baseline calls (ReMax): their seed is the attempt number (greedy ignores it anyway)."""
VALIDATION_STREAM = 1000
"""Parent of the validation calls: indexed by the first prompt of the chunk."""


def derive_seed(parent: int, index: int, level: SeedLevel) -> int:
    """The seed of child `index` of `parent` at `level`: ``parent * STRIDES[level] + index``."""
    return parent * STRIDES[level] + index
