"""The run plan: what this run does where the config leaves the choice open (a null that means "auto") or implies it,
decided once on the driver from the validated config into one frozen `RunPlan` that the role specs, the trainer,
`easyrl check` and the memory plan read instead of deciding again.

The deciders are functions of the config (each documents its rule); `plan_of` calls each once. They are decisions,
not checks, so they live above the config: the estimator's needs come from the algorithm registry, which the config
must not import (it sits below the algorithms). Only this module (with `config/` and `rollout/`) reads
`trainer.max_staleness` or compares `worker.rollout.placement` (`tests/test_structure.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

from easyrl.algorithms import EstimatorNeeds
from easyrl.algorithms import estimator_needs as registered_needs
from easyrl.config import EasyRLConfig
from easyrl.config.algorithm import KLMode
from easyrl.config.backend import inline_blockers
from easyrl.config.diffusion_run import is_diffusion_run
from easyrl.rollout import WeightSync
from easyrl.trainer.step_math import OldPass, old_pass_rows


__all__ = [
    "DEFAULT_LOGPROB_RATIO",
    "Backend",
    "Placement",
    "RunPlan",
    "backend",
    "data_parallel_size",
    "effective_chunk_tokens",
    "effective_logprob_ratio",
    "effective_padding_free",
    "effective_reuse_first_forward",
    "effective_sleep_level",
    "estimator_needs",
    "old_log_prob_pass",
    "plan_of",
    "rollout_engines",
    "use_gpu",
    "weight_sync",
]


DEFAULT_LOGPROB_RATIO = 0.125
"""Share of prompts whose samples get vLLM log-probs when `worker.rollout.logprob_sample_ratio` is null and no rollout
correction reads them: enough for the engine-vs-actor figures (`rollout/token_prob_error`) at a small cost."""


class Placement(str, Enum):
    """Where the rollout engines run (`worker.rollout.placement`)."""

    COLOCATED = "colocated"
    """In the actor's processes (the HybridEngine), asleep while it trains."""
    SEPARATE = "separate"
    """Rollout workers of their own on `worker.rollout.n_gpus` more GPUs, resident, fed the policy's weights."""


class Backend(str, Enum):
    """What runs the workers (`trainer.backend`, `auto` resolved by `backend`)."""

    RAY = "ray"
    """A Ray worker process per role and rank (`easyrl.distributed.WorkerGroup`)."""
    INLINE = "inline"
    """Every role's one worker in the driver's own process (`easyrl.distributed.inline`)."""


Schedule = Literal["synchronous", "carry_over"]
Episode = Literal["single_turn", "tools", "whole_sample"]
Modality = Literal["text", "diffusion"]


@dataclass(frozen=True)
class RunPlan:
    """What this run does, decided once from its config (`plan_of`)."""

    use_gpu: bool
    """The workers train on GPUs (`use_gpu`)."""
    world_size: int
    """The trainer's workers per role: `trainer.nnodes * trainer.n_gpus_per_node`."""
    data_parallel_size: int
    """The actor's workers holding different samples (`data_parallel_size`)."""
    placement: Placement
    rollout_workers: int
    """Workers the engines span: the actor's (colocated) or `worker.rollout.n_gpus` (separate)."""
    ranks_per_engine: int
    """Workers one engine spans (tensor parallelism)."""
    rollout_engines: int
    """Engines a generate call is split over (`rollout_engines`)."""
    weight_sync: WeightSync
    sleep_level: int
    """The engine's sleep level (`effective_sleep_level`)."""
    padding_free: bool
    """Packed rows in the training forward (`effective_padding_free` on this run's device)."""
    logprob_ratio: float
    """Share of prompts whose samples get the engine's log-probs (`effective_logprob_ratio`)."""
    staleness: int
    """`trainer.max_staleness`: how many policy versions a trained token may lag (0: synchronous)."""
    schedule: Schedule
    """`synchronous` (one engine session per step) or `carry_over` (groups in flight across steps)."""
    episode: Episode
    """`single_turn` (one completion per sample), `tools` (`worker.rollout.multi_turn` turns) or `whole_sample` (an
    engine that returns each sample whole in one call, with no tokens to carry over: a diffusion pipeline's images)."""
    modality: Modality
    """`text` (an LLM's token responses) or `diffusion` (a pipeline's images: `config.diffusion_run`); what the
    reward is given follows it (`trainer.reward_inputs`)."""
    chunk_tokens: int
    """The carry-over loop's tokens per engine call (`effective_chunk_tokens`)."""
    needs: EstimatorNeeds
    """What the advantage estimator declared it needs (a critic, greedy baselines)."""
    old_log_prob_pass: OldPass
    """Which rows each step's old-log-prob pass runs over: all before the update, all but the update's first
    mini-batch inside the update call, or none (`old_log_prob_pass`)."""
    ref_log_probs: bool
    """Each step computes the reference policy's log-probs (KL on)."""
    ref_worker: bool
    """A reference model runs in workers of its own (KL on, no LoRA: a LoRA actor serves its base as reference)."""
    critic: bool
    """A critic runs (the estimator needs one) and each step computes values."""
    teacher_worker: bool
    """A local distillation teacher runs in workers of its own and each step computes its log-probs."""
    backend: Backend
    """What runs the workers (`backend`)."""
    backend_reason: str
    """Why: the config's explicit choice, or what `auto` saw."""

    @property
    def separate(self) -> bool:
        """The engines run in rollout workers of their own (`Placement.SEPARATE`)."""
        return self.placement is Placement.SEPARATE

    @property
    def own_rollout_workers(self) -> int:
        """Workers started for rollout alone: `rollout_workers` when separate, else 0 (the actor's host the
        engines)."""
        return self.rollout_workers if self.separate else 0


def plan_of(cfg: EasyRLConfig, task: str = "rl") -> RunPlan:
    """The run plan of the validated config `cfg` for `task` (`rl`, or `sft`: `easyrl sft`): every decider called
    once."""
    rollout = cfg.worker.rollout
    world_size = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    placement = Placement(rollout.placement)
    gpu = use_gpu(cfg)
    kl_on = cfg.algorithm.kl_mode != KLMode.OFF
    needs = estimator_needs(cfg)
    runner, reason = backend(cfg, task)
    return RunPlan(
        use_gpu=gpu,
        world_size=world_size,
        data_parallel_size=data_parallel_size(cfg),
        placement=placement,
        rollout_workers=rollout.n_gpus if placement is Placement.SEPARATE else world_size,
        ranks_per_engine=rollout.ranks_per_engine,
        rollout_engines=rollout_engines(cfg),
        weight_sync=weight_sync(cfg),
        sleep_level=effective_sleep_level(cfg),
        padding_free=effective_padding_free(cfg, gpu),
        logprob_ratio=effective_logprob_ratio(cfg),
        staleness=cfg.trainer.max_staleness,
        schedule="carry_over" if cfg.trainer.max_staleness > 0 else "synchronous",
        episode=_episode(cfg),
        modality="diffusion" if is_diffusion_run(cfg) else "text",
        chunk_tokens=effective_chunk_tokens(cfg),
        needs=needs,
        old_log_prob_pass=old_log_prob_pass(cfg, gpu),
        ref_log_probs=kl_on,
        ref_worker=kl_on and cfg.worker.actor.model.lora.rank == 0,
        critic=needs.needs_critic,
        teacher_worker=cfg.algorithm.distill.teacher.local,
        backend=runner,
        backend_reason=reason,
    )


def backend(cfg: EasyRLConfig, task: str = "rl") -> tuple[Backend, str]:
    """(what runs the workers, why). `trainer.backend: auto` picks inline exactly when nothing rules it out
    (`easyrl.config.backend.inline_blockers`: more than one rank per role or node, rollout workers of their own, an
    engine that has not run inline, a served judge) and no Ray cluster is named to join (`RAY_ADDRESS`); an explicit
    choice is taken as it is (the config's validation refuses an `inline` that cannot be)."""
    chosen = cfg.trainer.backend
    if chosen != "auto":
        return Backend(chosen), "trainer.backend"
    blockers = inline_blockers(cfg, task)
    if os.environ.get("RAY_ADDRESS"):
        blockers.append("RAY_ADDRESS names a cluster to join")
    if blockers:
        return Backend.RAY, "auto: " + "; ".join(blockers)
    return Backend.INLINE, "auto: one worker per role on this node and nothing needs a process of its own"


def use_gpu(cfg: EasyRLConfig) -> bool:
    """Whether the workers train on GPUs (`trainer.device`, `auto`: when CUDA is available)."""
    if cfg.trainer.device == "cpu":
        return False
    if cfg.trainer.device == "cuda":
        return True
    return torch.cuda.is_available()


def estimator_needs(cfg: EasyRLConfig) -> EstimatorNeeds:
    """What `algorithm.adv_estimator` declared it needs, as registered (a user's `algorithm.user_modules` included)."""
    return registered_needs(cfg.algorithm.adv_estimator)


def weight_sync(cfg: EasyRLConfig) -> WeightSync:
    """How the actor pushes its weights into its engine: all of them, a LoRA policy merged, or its adapters."""
    lora = cfg.worker.actor.model.lora
    return WeightSync.resolve(lora.rank, lora.rollout_sync)


def effective_sleep_level(cfg: EasyRLConfig) -> int:
    """`worker.rollout.sleep_level`, or when null: 1 when the engine keeps its base weights across steps (LoRA with
    `rollout_sync: adapter` sends only the adapters), else 2 (each wake is followed by a full weight sync, so the
    level-1 copy of the weights to host memory and back would be thrown away)."""
    level = cfg.worker.rollout.sleep_level
    if level is not None:
        return level
    return weight_sync(cfg).sleep_level  # the one rule, shared with the spec


def effective_padding_free(cfg: EasyRLConfig, on_gpu: bool) -> bool:
    """`worker.actor.padding_free`, or when null: packed rows on GPUs (the varlen kernels skip the padding) and
    whenever a role splits rows with Ulysses (it needs packed rows), padded rows on CPU (per-sequence attention over
    packed rows is slower there than one padded batch: 0.30 s against 0.18 s per demo update)."""
    explicit = cfg.worker.actor.padding_free
    if explicit is not None:
        return explicit
    return on_gpu or cfg.worker.actor.sp_size > 1 or cfg.worker.critic.ulysses_size > 1


def data_parallel_size(cfg: EasyRLConfig, role: str = "actor") -> int:
    """Workers holding different samples: all workers / the role's sequence-parallel group (`ulysses_size`, times
    the actor's `ring_size`: the ranks of a group share their samples)."""
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // int(getattr(cfg.worker, role).sp_size)


def effective_chunk_tokens(cfg: EasyRLConfig) -> int:
    """`worker.rollout.chunk_tokens`, or when null a quarter of `data.max_response_length` rounded up: each response
    then takes up to four engine calls, and a step's session can end between any two of them."""
    return cfg.worker.rollout.chunk_tokens or -(-cfg.data.max_response_length // 4)


def rollout_engines(cfg: EasyRLConfig) -> int:
    """How many engines a generate call is split over: the actor's workers (colocated) or the rollout workers
    (separate), over the workers one engine spans."""
    rollout = cfg.worker.rollout
    separate = Placement(rollout.placement) is Placement.SEPARATE
    workers = rollout.n_gpus if separate else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // rollout.ranks_per_engine


def effective_logprob_ratio(cfg: EasyRLConfig) -> float:
    """`worker.rollout.logprob_sample_ratio`, or when null: 1 when a rollout correction (or bypass mode) reads them or
    rollouts are asynchronous (`trainer.max_staleness` >= 1), else 1/8. The vLLM engine applies it per prompt; the
    HF engine gives every sample's log-probs whenever it is above 0."""
    ratio = cfg.worker.rollout.logprob_sample_ratio
    if ratio is not None:
        return ratio
    # asynchronous rollouts keep every token's behaviour log-prob (the versioned record)
    reads = cfg.algorithm.correction.reads_rollout_log_probs or cfg.trainer.max_staleness > 0
    return 1.0 if reads else DEFAULT_LOGPROB_RATIO


def old_log_prob_pass(cfg: EasyRLConfig, on_gpu: bool | None = None) -> OldPass:
    """Which rows each step's old-log-prob pass runs over (`step_math.old_pass_rows` on this config; `on_gpu`: the
    plan's `use_gpu`, decided here when None), with mini-batch 1's old log-probs taken from the update's first forward
    (`effective_reuse_first_forward`) where that applies."""
    acfg, alg = cfg.worker.actor, cfg.algorithm
    return old_pass_rows(
        distill=alg.distill.enabled,
        ppo_epochs=acfg.ppo_epochs,
        mini_batches=cfg.data.rollout_batch_size // acfg.global_batch_size,
        kl_in_reward=alg.kl_mode == KLMode.IN_REWARD,
        correction=alg.correction.active,
        adaptive_entropy=alg.adaptive_entropy,
        bypass=alg.correction.bypass_mode,
        reuse_first_forward=effective_reuse_first_forward(cfg, use_gpu(cfg) if on_gpu is None else on_gpu)[0],
    )


def effective_reuse_first_forward(cfg: EasyRLConfig, on_gpu: bool) -> tuple[bool, str]:
    """(`worker.actor.reuse_first_forward` resolved, why). Null (auto): on for GPU runs (the pass's forward over
    mini-batch 1 is work the update's first forward repeats), off on CPU: the update's micro-batches are not the
    pass's, so mini-batch 1's old log-probs would round otherwise and CPU runs' recorded figures (the golden
    trajectory) would move. A diffusion run's actor has no such path: off whatever the key says."""
    explicit = cfg.worker.actor.reuse_first_forward
    if is_diffusion_run(cfg):
        return False, "a diffusion actor scores its denoising steps in a pass of its own"
    if explicit is not None:
        return explicit, f"worker.actor.reuse_first_forward: {str(explicit).lower()}, as set"
    if on_gpu:
        return True, "auto on GPU"
    return False, "auto on CPU: keeps the pass's rounding of mini-batch 1, so recorded CPU figures stay"


def _episode(cfg: EasyRLConfig) -> Episode:
    """What one sample is: a diffusion pipeline's image comes whole from one engine call (nothing to continue), a
    tool run's trajectory takes turns, anything else is one completion."""
    if is_diffusion_run(cfg):
        return "whole_sample"
    return "tools" if cfg.worker.rollout.multi_turn.enabled else "single_turn"
