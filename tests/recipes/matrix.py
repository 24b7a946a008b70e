"""The recipe matrix, in the order a lent GPU runs it: the families first (what the README's GPU column claims),
then the features. Three self-checks (never in the matrix) give the runner a recipe that fails, one that hangs and
one that kills its process, so a CPU test sees each reported with its cause."""

from __future__ import annotations

import os
import time

from tests.recipes.base import Context, Outcome, Recipe, expect
from tests.recipes.families import FAMILIES
from tests.recipes.features import FEATURES


def _fails(ctx: Context) -> Outcome:
    expect(False, "a check that does not hold (runner self-check)")
    return Outcome("unreachable")


def _hangs(ctx: Context) -> Outcome:
    time.sleep(3600)
    return Outcome("unreachable")


def _dies(ctx: Context) -> Outcome:
    print("runner self-check: the process exits in the middle of a recipe", flush=True)
    os._exit(3)


SELF_CHECKS = (
    Recipe("selfcheck_fails", "self", _fails, 5, cpu=True),
    Recipe("selfcheck_hangs", "self", _hangs, 2, cpu=True),
    Recipe("selfcheck_dies", "self", _dies, 5, cpu=True),
)
MATRIX = (*FAMILIES, *FEATURES)
RECIPES: dict[str, Recipe] = {r.name: r for r in (*MATRIX, *SELF_CHECKS)}
CPU_SMOKE = ("qwen2_5", "lora_merged", "ppo_critic")
"""What `--device cpu` runs by default (`bash scripts/gpu_checks.sh cpu_smoke`, in CI): the runner itself, over
the HF engine, on a family and two features."""
