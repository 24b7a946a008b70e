"""What a recipe is, what it runs in, and the checks every RL recipe passes.

A recipe is a function of a :class:`Context` (its own folder, the device, tiny models built once per process) that
trains 2 steps and returns an :class:`Outcome`: the logged rows and a line saying what its own check saw. The checks
every RL recipe passes (:func:`check_rl`): both steps logged and finite, step 2 sampled by the policy updated in
step 1 (the weights reached the engine), and the numerics gate: `rollout/token_prob_error` at or under
:data:`GATE` at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


GATE = 1.05
"""The bound on `rollout/token_prob_error` (mean exp|log p_engine - log p_trainer|) that NeMo-RL gates its recipes
on in bf16. The update's lr (:data:`LR`) moves a tiny model's log-probs by far more than 5%, so an engine left with
step 1's weights fails it at step 2."""
LR = 1e-2
"""The recipes' learning rate: large enough that an engine still on the old weights misses the gate at step 2."""
KV_CACHE_BYTES = 256 << 20
"""vLLM's KV cache per engine on a GPU: sized, not profiled, so engines of recipes run side by side never see each
other's memory moving during vLLM's start-up profile (which it refuses), and a tiny run reserves no more."""
GAE = {
    "algorithm.adv_estimator": "gae",
    "worker.critic.global_batch_size": 2,
    "worker.critic.micro_batch_size_per_device_for_update": 2,
}
"""PPO with a critic, at the recipes' batch of 2 prompts."""


@dataclass
class Outcome:
    """What a recipe saw."""

    effect: str
    """The recipe's own check, in words (the table's last column)."""
    rows: list[dict[str, Any]] | None = None
    """The logged steps of an RL run: :func:`check_rl` runs on them. None: a run that is not RL (`easyrl sft`)."""
    staleness: int = 0
    """`trainer.max_staleness` of the run: step 2 may still sample with the policy that many versions old."""


@dataclass
class Context:
    """Where a recipe runs: its own folder, the device, and what this process built already."""

    work: Path
    gpu: bool
    cache: dict[str, str] = field(default_factory=dict)

    def edits(self, engine: str = "vllm") -> dict[str, Any]:
        """The device's settings for a 2-step tiny run: vLLM (or the HF engine where `engine` says so) on one GPU, or
        the HF engine on one CPU worker; the engine's log-probs on every sample (the numerics gate reads them)."""
        common = {
            "trainer.n_gpus_per_node": 1,
            "worker.rollout.logprob_sample_ratio": 1.0,
            # 4 samples a prompt: a group whose samples all score alike (no gradient) is then rare at step 1
            "worker.rollout.n": 4,
            "worker.actor.optim.lr": LR,
        }
        if not self.gpu:
            return common | {"trainer.device": "cpu", "worker.rollout.name": "hf", "worker.rollout.dtype": "fp32"}
        gpu = common | {"trainer.device": "cuda", "worker.rollout.dtype": "bf16", "worker.rollout.name": engine}
        if engine == "vllm":
            gpu |= {
                # Start-up savings: a tiny run's engine start is dominated by torch.compile and CUDA-graph capture.
                "worker.rollout.enforce_eager": True,
                "worker.rollout.gpu_memory_utilization": 0.05,
                "worker.rollout.engine_kwargs": {"kv_cache_memory_bytes": KV_CACHE_BYTES, "max_num_seqs": 64},
            }
        return gpu

    def train(
        self,
        model: str,
        data: dict[str, str],
        edits: dict[str, Any],
        *,
        engine: str = "vllm",
        weights: bool = False,
        steps: int = 2,
    ) -> tuple[list[dict[str, Any]], dict | None, dict | None]:
        """`steps` steps of the test config (tests/conftest.py) with the device's settings and `edits`."""
        from tests.conftest import train_steps

        return train_steps(self.work / "run", model, data, self.edits(engine) | edits, steps=steps, weights=weights)

    def built(self, key: str, build: Callable[[Path], str]) -> str:
        """`build(folder)` once per process (tiny models, data), by `key`."""
        if key not in self.cache:
            folder = self.work.parent / "_shared" / key
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.cache[key] = build(folder)
        return self.cache[key]


@dataclass(frozen=True)
class Recipe:
    name: str
    group: str
    """`family` or `feature`."""
    run: Callable[[Context], Outcome]
    limit_s: float = 60.0
    """Seconds it may take on a GPU, its share of the process's start-up included (x3 on a CPU)."""
    cpu: bool = False
    """It has a CPU form (the HF engine, gloo): `--device cpu` may run it."""


class RecipeFailed(AssertionError):
    """A recipe's check did not hold: the message says which and with what figures."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeFailed(message)


def check_rl(rows: list[dict[str, Any]], staleness: int = 0) -> dict[str, float]:
    """The checks of every RL recipe; returns the figures the table shows (the worst step's)."""
    steps = [r.get("step") for r in rows]
    expect(len(rows) >= 2 and steps == list(range(1, len(rows) + 1)), f"expected steps 1, 2, ...; logged {steps}")
    for row in rows:
        bad = sorted(k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v))
        expect(not bad, f"step {row['step']}: non-finite {bad}")
    # The update of step k makes policy version k: the last step samples with the newest (at most `staleness`
    # versions behind, and never the initial weights: the pushed ones reached the engine).
    last, want = rows[-1], len(rows) - 1
    newest, oldest = last.get("rollout/policy_version_max"), last.get("rollout/policy_version_min")
    expect(newest is not None and newest <= want, f"step {len(rows)} sampled with policy versions up to {newest}")
    floor = max(1, want - staleness)
    expect(oldest is not None and oldest >= floor, f"step {len(rows)} sampled with policy version {oldest} < {floor}")
    # ... and those weights differ from the initial ones, or a stale engine would pass the gate unseen
    grads = [r.get("actor/grad_norm", 0.0) for r in rows[: int(oldest)]]
    expect(any(g > 0 for g in grads), f"the updates before the last step's sampling had no gradient ({grads})")
    errors = [r.get("rollout/token_prob_error") for r in rows]
    # With staleness a step may train nothing the compared weights sampled (the figure leaves older versions out)
    logged = any(e is not None for e in errors) if staleness else all(e is not None for e in errors)
    expect(logged, f"rollout/token_prob_error not logged at {'any' if staleness else 'every'} step: {errors}")
    worst = max(float(e) for e in errors if e is not None)
    expect(worst <= GATE, f"rollout/token_prob_error {worst:.4f} > {GATE} (engine and trainer disagree)")
    figures = {"token_prob_error": worst}
    diffs = [r["rollout/logprob_diff_max"] for r in rows if "rollout/logprob_diff_max" in r]
    if diffs:
        figures["logprob_diff_max"] = max(diffs)
    return figures


def moved(before: dict | None, after: dict | None, part: str) -> bool:
    """Whether any parameter whose name contains `part` changed (at least one must exist)."""
    import torch

    assert before is not None and after is not None
    names = [n for n in before if part in n]
    expect(bool(names), f"no parameter named like {part!r}")
    return any(not torch.equal(before[n], after[n]) for n in names)
