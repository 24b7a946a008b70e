"""`trainer.backend`: which engine runs the workers (Ray's processes, or the driver's own), and what rules out the
driver's own. The choice itself is the run plan's (`easyrl.trainer.plan.backend`); the rule lives here so that the
config's validation refuses an explicit `inline` the plan would refuse, with the same words."""

from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig

__all__ = ["BACKENDS", "inline_blockers"]

BACKENDS = ("auto", "ray", "inline")


def inline_blockers(cfg: EasyRLConfig, task: str = "rl") -> list[str]:
    """Why the workers of `cfg` cannot all run in the driver's process (empty: they can): every role must be one
    rank on this node, and nothing may need a process of its own; for `task` `rl` (not `sft`, which has no rollout)
    the engine must declare it runs inline too. The reward pool is a process pool under either backend, and a remote
    teacher or judge is a client: neither rules inline out."""
    from easyrl.config.engines import engine_capabilities

    t = cfg.trainer
    blockers = []
    if t.nnodes > 1:
        blockers.append(f"trainer.nnodes is {t.nnodes} (one process cannot span nodes)")
    if t.n_gpus_per_node > 1:
        blockers.append(f"trainer.n_gpus_per_node is {t.n_gpus_per_node} (inline runs one worker per role)")
    if task == "sft":
        return blockers
    rollout = cfg.worker.rollout
    if rollout.placement == "separate":
        blockers.append("worker.rollout.placement is separate (rollout workers of their own)")
    if not engine_capabilities(rollout.name).inline:
        blockers.append(f"the {rollout.name} engine has not run in the driver's process yet")
    if cfg.worker.reward.judge.model.local:
        blockers.append("worker.reward.judge.model.model_path is set (the judge's server runs in a Ray actor)")
    return blockers
