"""The rollout loops of a run: the loop builders of `easyrl.rollout.producer` fed the engine count and carry-over
chunk this run's plan decided (`easyrl.trainer.plan`)."""

from __future__ import annotations

from collections.abc import Callable

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout import RolloutLoop
from easyrl.rollout.loop import Scorer
from easyrl.rollout.producer import build_rollout_loop
from easyrl.rollout.producer import multi_turn_loop as producer_multi_turn_loop
from easyrl.rollout.producer import one_session_loop as producer_one_session_loop
from easyrl.trainer.plan import RunPlan


__all__ = ["multi_turn_loop", "one_session_loop", "rollout_loop"]


def rollout_loop(
    cfg: EasyRLConfig,
    plan: RunPlan,
    draw: Callable[[int], Batch] | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    scorer: Scorer | None = None,
) -> RolloutLoop:
    """How the trainer turns prompts into rows (`easyrl.rollout.producer.build_rollout_loop`, with this run's engine
    count and carry-over chunk): the trainer holds the `RolloutLoop` protocol only, so a new loop is chosen in the
    rollout room from the config section that turns it on and `fit()` does not change (docs/architecture.md, "Adding
    a rollout loop")."""
    return build_rollout_loop(
        cfg,
        draw=draw,
        eos_id=eos_id,
        pad_id=pad_id,
        scorer=scorer,
        engines=plan.rollout_engines,
        chunk_tokens=plan.chunk_tokens,
        staleness=plan.staleness,
        tools=plan.episode == "tools",
        whole=plan.episode == "whole_sample",
        beside=plan.separate,
    )


def one_session_loop(cfg: EasyRLConfig, plan: RunPlan, loop: RolloutLoop) -> RolloutLoop:
    """The loop for validation and ReMax's greedy baselines (`easyrl.rollout.producer.one_session_loop`)."""
    return producer_one_session_loop(
        cfg,
        loop,
        plan.rollout_engines,
        staleness=plan.staleness,
        tools=plan.episode == "tools",
        whole=plan.episode == "whole_sample",
    )


def multi_turn_loop(cfg: EasyRLConfig, plan: RunPlan) -> RolloutLoop:
    """The multi-turn loop of `worker.rollout.multi_turn` (`easyrl check` builds it to load the tools early)."""
    return producer_multi_turn_loop(cfg, plan.rollout_engines)
