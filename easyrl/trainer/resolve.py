"""What the run does where the config leaves the choice open (a null that means "auto") or implies it: decided once, on
the driver, from the validated config, for the role specs, the trainer and `easyrl check`.

They are decisions, not checks, so they live above the config: the estimator's needs come from the algorithm
registry, which the config must not import (it sits below the algorithms).
"""

from __future__ import annotations

from easyrl.algorithms import EstimatorNeeds
from easyrl.algorithms import estimator_needs as registered_needs
from easyrl.config import EasyRLConfig
from easyrl.rollout import RolloutLoop, SingleTurnLoop, WeightSync


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


def rollout_loop(cfg: EasyRLConfig) -> RolloutLoop:
    """How the trainer turns prompts into rows: today one engine session per batch, one response per sample
    (`SingleTurnLoop`). A new loop (multi-turn, asynchronous) is chosen here from the config section that turns it on;
    `fit()` does not change (docs/architecture.md, "Adding a rollout loop")."""
    del cfg  # one loop so far: the config has nothing to choose between yet
    return SingleTurnLoop()
