"""What the run does where the config leaves the choice open (a null that means "auto") or implies it: decided once, on
the driver, from the validated config, for the role specs, the trainer and `easyrl check`.

They are decisions, not checks, so they live above the config: the estimator's needs come from the algorithm
registry, which the config must not import (it sits below the algorithms).
"""

from __future__ import annotations

from collections.abc import Callable

from easyrl.algorithms import EstimatorNeeds
from easyrl.algorithms import estimator_needs as registered_needs
from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout import RolloutLoop, WeightSync
from easyrl.rollout.loop import Scorer
from easyrl.rollout.producer import build_rollout_loop
from easyrl.rollout.producer import multi_turn_loop as producer_multi_turn_loop
from easyrl.rollout.producer import one_session_loop as producer_one_session_loop


__all__ = [
    "data_parallel_size",
    "effective_chunk_tokens",
    "effective_padding_free",
    "effective_sleep_level",
    "estimator_needs",
    "multi_turn_loop",
    "one_session_loop",
    "rollout_engines",
    "rollout_loop",
]


def estimator_needs(cfg: EasyRLConfig) -> EstimatorNeeds:
    """What `algorithm.adv_estimator` declared it needs, as registered (a user's `algorithm.user_modules` included)."""
    return registered_needs(cfg.algorithm.adv_estimator)


def effective_sleep_level(cfg: EasyRLConfig) -> int:
    """`worker.rollout.sleep_level`, or when null: 1 when the engine keeps its base weights across steps (LoRA with
    `rollout_sync: adapter` sends only the adapters), else 2 (each wake is followed by a full weight sync, so the
    level-1 copy of the weights to host memory and back would be thrown away)."""
    level = cfg.worker.rollout.sleep_level
    if level is not None:
        return level
    lora = cfg.worker.actor.model.lora
    return WeightSync.resolve(lora.rank, lora.rollout_sync).sleep_level  # the one rule, shared with the spec


def effective_padding_free(cfg: EasyRLConfig, on_gpu: bool) -> bool:
    """`worker.actor.padding_free`, or when null: packed rows on GPUs (the varlen kernels skip the padding) and
    whenever a role splits rows with Ulysses (it needs packed rows), padded rows on CPU (per-sequence attention over
    packed rows is slower there than one padded batch: 0.30 s against 0.18 s per demo update)."""
    explicit = cfg.worker.actor.padding_free
    if explicit is not None:
        return explicit
    return on_gpu or cfg.worker.actor.ulysses_size > 1 or cfg.worker.critic.ulysses_size > 1


def data_parallel_size(cfg: EasyRLConfig, role: str = "actor") -> int:
    """Workers holding different samples: all workers / `worker.<role>.ulysses_size` (the ranks of a
    sequence-parallel group share their samples)."""
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // int(getattr(cfg.worker, role).ulysses_size)


def effective_chunk_tokens(cfg: EasyRLConfig) -> int:
    """`worker.rollout.chunk_tokens`, or when null a quarter of `data.max_response_length` rounded up: each response
    then takes up to four engine calls, and a step's session can end between any two of them."""
    return cfg.worker.rollout.chunk_tokens or -(-cfg.data.max_response_length // 4)


def rollout_engines(cfg: EasyRLConfig) -> int:
    """How many engines a generate call is split over: the actor's workers (colocated) or the rollout workers
    (separate), over the workers one engine spans."""
    rollout = cfg.worker.rollout
    workers = rollout.n_gpus if rollout.placement == "separate" else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // rollout.ranks_per_engine


def rollout_loop(
    cfg: EasyRLConfig,
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
        engines=rollout_engines(cfg),
        chunk_tokens=effective_chunk_tokens(cfg),
    )


def one_session_loop(cfg: EasyRLConfig, loop: RolloutLoop) -> RolloutLoop:
    """The loop for validation and ReMax's greedy baselines (`easyrl.rollout.producer.one_session_loop`)."""
    return producer_one_session_loop(cfg, loop, rollout_engines(cfg))


def multi_turn_loop(cfg: EasyRLConfig) -> RolloutLoop:
    """The multi-turn loop of `worker.rollout.multi_turn` (`easyrl check` builds it to load the tools early)."""
    return producer_multi_turn_loop(cfg, rollout_engines(cfg))
