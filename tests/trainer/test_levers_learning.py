"""The learning is unchanged by the speed levers (issue 44 item 6): the tiny text demo the golden trajectory uses
(tests/conftest.py's config: GRPO, the HF engine, 2 FSDP2 workers over gloo, the digit task), run once with every
update lever that has a CPU path at its default and once with all of them at their other value, gives the same
trajectory: rewards, losses, grad norms and every other metric of the math, step by step.

Tolerance: `RTOL` relative, `ATOL` absolute for metrics near zero: the golden trajectory's (tests/trainer/test_e2e.py),
which a real change of the algorithm exceeds (1.3e-4 to 6e-3 relative). Checkpointing recomputes the same arithmetic
(bit for bit: tests/workers/test_update_levers_equivalence.py); the deferred sync sums the two ranks' gradients once
per mini-batch instead of per micro-batch and the forward-only budget packs more rows into a pass, so float32 sums
run in another order. Measured on 3 steps (2-core box, 2026-11-28): 10 metrics differ, at most 9.2e-6 relative
(`actor/ppo_kl`, step 3), or below 1e-7 absolute (`actor/pg_loss` and `rollout/logprob_diff_mean` near zero).

A lever joins with one line in `CPU_LEVERS`: its key and its non-default value.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.conftest import train_steps


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
STEPS = 2
BUDGET = 64
"""The update's token budget per worker: a row is at most 48 + 8 tokens, so a micro-batch holds one row and the
forward-only budget below packs several."""
DEMO = {
    # the real runs' defaults: padding-free rows in token-budget micro-batches, the fused log-prob head
    "worker.actor.padding_free": True,
    "worker.actor.dynamic_batching": True,
    "worker.actor.fused_logprobs": True,
    "worker.actor.max_token_len_per_gpu": BUDGET,
    "algorithm.disable_kl": False,  # a reference pass too: the forward-only budget sizes it as well
    "algorithm.use_kl_loss": True,
}
CPU_LEVERS: dict[str, Any] = {
    "worker.actor.model.enable_gradient_checkpointing": True,
    "worker.actor.log_prob_max_token_len_per_gpu": 4 * BUDGET,
    "worker.actor.defer_gradient_sync": True,  # the demo's 2 gloo workers: a reduction to defer
    # the demo's 2 mini-batches a step: mini-batch 1's old log-probs from the update's first forward (auto: GPU only)
    "worker.actor.reuse_first_forward": True,
}
"""Every update lever with a CPU path, at its non-default value (`easyrl.update_levers` and the run plan decide them
on a GPU). Not here: `worker.actor.model.compile_layers` (a CPU compile costs ~20-50 s in each worker process: it
joins them in the `extended` test at the end; its `make test` proof is tests/models/test_compiled_layers.py) and
`worker.actor.fused_head_kernel: triton` (CUDA or Triton's interpreter only: tests/workers/test_head_kernel.py)."""
OFF: dict[str, Any] = {
    "worker.actor.model.enable_gradient_checkpointing": False,
    "worker.actor.log_prob_max_token_len_per_gpu": None,
    "worker.actor.defer_gradient_sync": False,
    "worker.actor.reuse_first_forward": False,
}
"""What the off run sets where a lever's default is auto (null): the value auto takes on CPU."""
RTOL = 1e-4
ATOL = 1e-6
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")
"""Wall time and memory, not the math."""


def _math(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def mismatches(got: list[dict[str, float]], want: list[dict[str, float]]) -> list[str]:
    """Metrics of `got` that differ from `want` beyond the tolerance, one line each."""
    if [sorted(r) for r in got] != [sorted(w) for w in want]:
        return [f"metric keys differ: {[sorted(set(r) ^ set(w)) for r, w in zip(got, want, strict=False)]}"]
    bad = []
    for row, ref in zip(got, want, strict=True):
        for key, value in ref.items():
            if not math.isclose(row[key], value, rel_tol=RTOL, abs_tol=ATOL):
                bad.append(f"step {row['step']} {key}: {row[key]!r} with the levers, {value!r} without")
    return bad


def test_tolerance_catches_a_real_change() -> None:
    want = [{"step": 1, "actor/pg_loss": 0.25, "reward/overall": 0.5}]
    assert mismatches([{**want[0], "actor/pg_loss": 0.25 * (1 + 1e-5)}], want) == []
    assert mismatches([{**want[0], "actor/pg_loss": 0.25 * (1 + 1e-3)}], want)[0].startswith("step 1 actor/pg_loss")
    assert mismatches([{"step": 1}], want)[0].startswith("metric keys differ")


@pytest.fixture(scope="module")
def off_run(tmp_path_factory, tiny_model_dir, digits_data) -> list[dict[str, Any]]:
    """The demo with every lever off: the one trajectory every comparison of this module is made against."""
    rows, _, _ = train_steps(tmp_path_factory.mktemp("off"), tiny_model_dir, digits_data, DEMO | OFF, steps=STEPS)
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # the demo learns something to compare: the policy moved
    return rows


def test_every_cpu_lever_leaves_the_trajectory_unchanged(tmp_path, tiny_model_dir, digits_data, off_run) -> None:
    assert set(OFF) == set(CPU_LEVERS), "a lever in CPU_LEVERS needs its off value in OFF"
    on, _, _ = train_steps(tmp_path, tiny_model_dir, digits_data, DEMO | CPU_LEVERS, steps=STEPS)
    assert [r["step"] for r in on] == list(range(1, STEPS + 1))
    for key in ("reward/overall", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert all(key in r for r in on), key
    # the levers took effect: no driver-side old pass, each worker ran it inside the update after mini-batch 1
    assert all("timing_s/old" not in r and r["timing_s/old_in_update"] > 0 for r in on)
    assert all("timing_s/old" in r for r in off_run)
    bad = mismatches(_math(on), _math(off_run))
    assert not bad, f"{len(bad)} metrics moved with {sorted(CPU_LEVERS)}:\n" + "\n".join(bad[:30])


@pytest.mark.extended
def test_compiled_layers_join_the_levers_and_the_trajectory_stays(
    tmp_path, tiny_model_dir, digits_data, off_run
) -> None:
    """`worker.actor.model.compile_layers` on top of every lever above (extended: each of the 2 workers compiles
    its decoder layers, 20-50 s on this CPU): the same trajectory within the same tolerance. Its `make test` proof
    is tests/models/test_compiled_layers.py (log-probs and gradients against eager, no recompiles)."""
    levers = CPU_LEVERS | {"worker.actor.model.compile_layers": True}
    on, _, _ = train_steps(tmp_path, tiny_model_dir, digits_data, DEMO | levers, steps=STEPS)
    assert [r["step"] for r in on] == list(range(1, STEPS + 1))
    bad = mismatches(_math(on), _math(off_run))
    assert not bad, f"{len(bad)} metrics moved with {sorted(levers)}:\n" + "\n".join(bad[:30])
