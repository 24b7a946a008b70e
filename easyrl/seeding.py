"""Every sampling seed of a run, derived by one function from its parent.

The seeds form a tree: the run's `worker.rollout.seed` -> one generate call (a training attempt, a greedy
baseline, a validation chunk) -> one sampled row, indexed by its place in the driver's whole batch (sample `j` of
prompt `p` is row `p * n + j`) -> each engine call a row takes (`call_seed`: a turn of a tool episode, a chunk of a
carry-over response; every schedule seeds them alike). No level depends on the layout: which engine or rank generates a prompt, and what
else shares its batch, does not enter its seed (see `prompt_seeds`). Each level multiplies its parent by a
stride and adds the child's index, so two children of one parent never share a seed while the index stays below
the stride, and a resumed run re-derives the very same seeds. The strides are the numbers the seeds have always been
made with: changing one changes every sampled token of a run (the golden-trajectory test would catch it).
"""

from __future__ import annotations

from typing import Literal

import torch


SeedLevel = Literal["attempt", "call", "row"]

STRIDES: dict[SeedLevel, int] = {
    "attempt": 1000,  # a step (or a stream) -> its generation attempts (online filtering makes < 1000 per step)
    "call": 100_003,  # rollout.seed -> a generate call's seed (a prime: calls of nearby runs do not collide)
    "row": 100_003,  # a call -> each sampled row of the whole batch (fewer than 100_003 rows per call)
}

GREEDY_STREAM = 0
"""Parent of the greedy-baseline calls (ReMax): their seed is the attempt number (greedy ignores it anyway)."""
VALIDATION_STREAM = 1000
"""Parent of the validation calls: indexed by the first prompt of the chunk."""


def derive_seed(parent: int, index: int, level: SeedLevel) -> int:
    """The seed of child `index` of `parent` at `level`: ``parent * STRIDES[level] + index``."""
    return parent * STRIDES[level] + index


SEED_COLUMN = "sample_seed"
"""The prompts' column (B,) that carries each prompt's seed to the engines (`prompt_seeds`)."""


def prompt_seeds(call_seed: int, num_prompts: int, n: int) -> torch.Tensor:
    """The seed of sample 0 of each of a call's `num_prompts` prompts, (B,) int64: the seed of its first row
    ``p * n`` of the whole batch. Sample `j` of a prompt takes this seed plus `j` (row ``p * n + j``), which is also
    how vLLM seeds the `n` children of one seeded request. The driver attaches these before the batch is split
    over the engines, so a prompt's samples do not depend on which engine draws them or on its neighbours."""
    if num_prompts * n >= STRIDES["row"]:
        raise ValueError(f"{num_prompts} prompts x n={n} rows exceed one call's {STRIDES['row']} row seeds")
    return torch.tensor([derive_seed(call_seed, p * n, "row") for p in range(num_prompts)], dtype=torch.int64)


def call_seed(row_seed: int, call: int) -> int:
    """The seed of engine call `call` (from 0) of the row seeded `row_seed`, whichever schedule drives it: the row
    seed itself for the first call (so a one-call response samples as the single-turn loop always has: the golden
    trajectory), then its `"row"` children. Fixed by the row and the call count alone, so a response cut into
    carry-over chunks, resumed after a checkpoint, or continued after a tool's output draws the same tokens under
    the synchronous and the carry-over schedule (`tests/rollout/test_schedule_at_zero.py`)."""
    return row_seed if call == 0 else derive_seed(row_seed, call, "row")
