"""Building what `fit()` drives: the data, the step arithmetic and the worker groups, on Ray or in this process
(`start_backend`, as the run plan says)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.config.engines import engine_capabilities, engine_env
from easyrl.config.worker import RewardConfig
from easyrl.trainer.engines import SeparateEngines
from easyrl.trainer.handles import (
    ActorGroup,
    CriticGroup,
    GroupHandle,
    RefGroup,
    RefSource,
    RolloutGroup,
    SFTGroup,
    TeacherSource,
)
from easyrl.trainer.plan import RunPlan
from easyrl.trainer.role_specs import build_role_specs


logger = logging.getLogger(__name__)


def build_data(cfg: EasyRLConfig) -> tuple[Any, Any, Any, Any]:
    """Tokenizer, train dataset, validation dataset (or None) and the resumable prompt sampler."""
    from easyrl.data import PromptSampler, RLDataset
    from easyrl.models import load_tokenizer

    mcfg = cfg.worker.actor.model
    logger.info("loading tokenizer from %s", mcfg.tokenizer_path)
    assert mcfg.tokenizer_path is not None
    tokenizer, processor = load_tokenizer(mcfg.tokenizer_path, trust_remote_code=mcfg.trust_remote_code)
    if cfg.algorithm.distill.enabled:
        check_teacher_tokenizer(cfg, tokenizer)
    logger.info("loading and checking training data %s", cfg.data.train_files)
    # an engine that processes pixels itself gets each prompt's raw images and videos beside the processed ones
    rollout_media = processor is not None and engine_capabilities(cfg.worker.rollout.name).raw_media
    train = RLDataset(cfg.data.train_files, cfg.data, tokenizer, processor, rollout_media)
    val = RLDataset(cfg.data.val_files, cfg.data, tokenizer, processor, rollout_media) if cfg.data.val_files else None
    check_env_rows(cfg, train, val)
    if len(train) < cfg.data.rollout_batch_size:
        from easyrl.config import ConfigError

        raise ConfigError(
            "data.rollout_batch_size",
            f"{cfg.data.rollout_batch_size} is larger than the {len(train)} usable training rows",
        )
    sampler = PromptSampler(len(train), cfg.data.rollout_batch_size, cfg.data.shuffle, cfg.data.seed)
    return tokenizer, train, val, sampler


def check_env_rows(cfg: EasyRLConfig, *datasets: Any) -> None:
    """A row naming an environment the run does not have stops `check` and `train` here, at load, with one line
    naming the row and the known environments (mid-run it would only be a dropped trajectory)."""
    mt = cfg.worker.rollout.multi_turn
    if not mt.enabled:
        return
    from easyrl.agent import unknown_env_row
    from easyrl.data.loading import DataError

    for data in datasets:
        problem = unknown_env_row(mt, data.rows()) if data is not None else None
        if problem is not None:
            raise DataError(problem)


def check_teacher_tokenizer(cfg: EasyRLConfig, student: Any) -> None:
    """The teacher scores the student's token ids as they are: both must map every token to the same id. One
    `ConfigError` naming the two tokenizers and how they differ otherwise (before any worker starts)."""
    from easyrl.config import ConfigError
    from easyrl.models import load_tokenizer, vocabulary_difference

    teacher = cfg.algorithm.distill.teacher
    path = teacher.tokenizer_path or teacher.model_path
    assert path is not None
    theirs, _ = load_tokenizer(path, trust_remote_code=teacher.trust_remote_code)
    difference = vocabulary_difference(student, theirs)
    if difference is not None:
        raise ConfigError(
            "algorithm.distill.teacher",
            f"the teacher's tokenizer ({path}) is not the student's ({cfg.worker.actor.model.tokenizer_path}): "
            f"{difference}. On-policy distillation scores the student's token ids under the teacher, so both must "
            "share one vocabulary: pick a teacher of the student's model family",
        )


def hang_watch_args(cfg: EasyRLConfig) -> dict[str, Any]:
    """Every worker group's heartbeat bound and where a frozen worker's stacks go: `<run folder>/hang_stacks`."""
    run_dir = cfg.trainer.save_checkpoint_path or "."
    return {"hang_timeout_s": cfg.trainer.hang_timeout_s, "stack_dir": os.path.join(run_dir, "hang_stacks")}


def count_steps(cfg: EasyRLConfig, steps_per_epoch: int) -> tuple[int, int]:
    """(training steps, optimizer steps of the actor over the run) for the LR schedule."""
    total = steps_per_epoch * cfg.trainer.total_epochs
    if cfg.trainer.max_steps is not None:
        total = min(total, cfg.trainer.max_steps)
    updates_per_step = cfg.data.rollout_batch_size // cfg.worker.actor.global_batch_size * cfg.worker.actor.ppo_epochs
    return total, total * updates_per_step


@dataclass
class PaddedBatch:
    batch: Batch
    real: int
    """How many leading samples are real (the rest repeat the last one to fill every worker)."""


class Workers:
    """The worker groups of a run: actor (+rollout engines when colocated), the optional reference and critic, and
    rollout workers of their own with `worker.rollout.placement: separate`."""

    def __init__(
        self, cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, media: dict[str, int] | None = None
    ) -> None:
        from easyrl.distributed import ResourcePool
        from easyrl.workers.critic import CriticWorker
        from easyrl.workers.teacher import TeacherWorker

        gpu = plan.use_gpu
        self.world_size = plan.world_size
        rollout_workers = plan.own_rollout_workers
        slots = self.world_size + rollout_workers  # a CPU run's logical CPUs: one per worker of either pool
        self.pool, group_cls = start_backend(cfg, plan, slots, engine_env(cfg.worker.rollout.name, gpu))
        self.rollout_pool: Any = None
        specs = build_role_specs(cfg, plan, optimizer_steps, self.world_size)
        roles = 1 + sum(spec is not None for spec in (specs.ref, specs.critic, specs.teacher))
        share: dict[str, Any] = {
            "num_cpus_per_worker": 1.0 / roles,
            "num_gpus_per_worker": (1.0 / roles) if gpu else 0.0,
            "call_timeout_s": cfg.trainer.worker_timeout_s,
            **hang_watch_args(cfg),
        }
        self.actor: ActorGroup  # set in the `try` below; each typed by what the driver calls (trainer/handles.py)
        self.ref: RefGroup | None = None
        self.critic: CriticGroup | None = None
        self.teacher: TeacherSource | None = None
        self.rollout: RolloutGroup | None = None
        self.judge_server: Any = None
        self._gpu = gpu
        try:
            tp = plan.ranks_per_engine
            sp = cfg.worker.actor.sp_size  # the reference follows the actor's split (ulysses x ring)
            actor_cls, ref_cls = role_classes(plan.modality)
            self.actor = group_cls(
                actor_cls, self.pool, "actor", specs.actor, ranks_per_engine=tp, ranks_per_dp=sp, **share
            )
            if specs.ref is not None:
                self.ref = group_cls(ref_cls, self.pool, "ref", specs.ref, ranks_per_dp=sp, **share)
            if specs.critic is not None:
                csp = cfg.worker.critic.ulysses_size
                self.critic = group_cls(CriticWorker, self.pool, "critic", specs.critic, ranks_per_dp=csp, **share)
            if specs.teacher is not None:  # the teacher follows the actor's split, as the reference does
                self.teacher = group_cls(TeacherWorker, self.pool, "teacher", specs.teacher, ranks_per_dp=sp, **share)
            if plan.separate:  # rollout workers of their own, on `n_gpus` devices of their own (resident engines)
                from easyrl.trainer.role_specs import rollout_role_spec
                from easyrl.workers.rollout_role import RolloutRole

                self.rollout_pool = ResourcePool(1, rollout_workers, gpu, name="easyrl-rollout")
                self.rollout = group_cls(
                    RolloutRole,
                    self.rollout_pool,
                    "rollout",
                    rollout_role_spec(specs.actor),
                    ranks_per_engine=tp,
                    num_cpus_per_worker=1.0,
                    num_gpus_per_worker=1.0 if gpu else 0.0,
                    call_timeout_s=cfg.trainer.worker_timeout_s,
                    **hang_watch_args(cfg),
                )
            if cfg.algorithm.distill.teacher.remote:  # a server: the driver asks it, no worker of its own
                from easyrl.scorers.teacher import RemoteTeacher

                self.teacher = RemoteTeacher(cfg.algorithm.distill.teacher)
            self._init_models(media or {})
            # Who answers `compute_ref_log_probs`: the ref workers, or the LoRA actor (its base, adapters off).
            self.ref_source: RefSource | None = self.actor if specs.actor.serves_reference else self.ref
            # What the rollout loop drives: the actor's own engines, or the rollout workers fed its weights.
            self.engines: SeparateEngines | ActorGroup = (
                SeparateEngines(self.rollout, self.actor, cfg.worker.rollout.weight_transfer)
                if self.rollout is not None
                else self.actor
            )
        except BaseException:
            self.shutdown()
            raise

    def serve_judge(self, reward: RewardConfig) -> RewardConfig:
        """Start the local judge's server (`worker.reward.judge.model.model_path`) beside the workers; returns the
        reward config pointing the judge at it. Stopped by `shutdown`."""
        from easyrl.scorers.served import LocalJudge

        self.judge_server = LocalJudge(reward, self._gpu)
        return self.judge_server.reward_config

    def _init_models(self, media_per_prompt: dict[str, int]) -> None:
        logger.info("loading models into the workers")
        pending = [self.actor.call_async("init_model", media_per_prompt)]
        pending += [
            group.call_async("init_model") for group in self._groups() if group not in (self.actor, self.rollout)
        ]
        if self.rollout is not None:
            pending.append(self.rollout.call_async("init_model", media_per_prompt))
        for handle in pending:
            handle.result()

    def _groups(self) -> list[GroupHandle]:
        """The worker groups started (a remote teacher is a client, not a group); the actor is unset until its group
        starts."""
        groups = (getattr(self, "actor", None), self.ref, self.critic, self.teacher, self.rollout)
        return [g for g in groups if isinstance(g, GroupHandle)]

    def teacher_call_metrics(self) -> dict[str, float]:
        """A remote teacher's request counts of the step (`teacher/requests`, ...); {} for a local teacher role."""
        stats = getattr(self.teacher, "stats", None)
        if stats is None:
            return {}
        from easyrl.scorers import finish_stats

        return finish_stats(stats.drain(), [stats.name])

    def pad_for_dp(self, batch: Batch) -> PaddedBatch:
        """Repeat the last sample so the batch splits evenly over the workers."""
        real = len(batch)
        extra = (-real) % self.world_size
        if extra:
            batch = batch.index(list(range(real)) + [real - 1] * extra)
        return PaddedBatch(batch, real)

    def memory_metrics(self) -> dict[str, float]:
        """The host's memory in use, and every worker's memory figures of the step (the largest over its ranks):
        the allocator's (CUDA) and the ``perf/mem/<role>/*`` ledger (see `easyrl.distributed.memory`)."""
        groups = self._groups()  # a remote teacher is a client: no memory to report
        if isinstance(self.engines, SeparateEngines) and self.engines.generating():
            # busy beside the update (asynchronous rollouts): asking now would wait for the call; their figures come
            # with a later step's
            groups = [g for g in groups if g is not self.rollout]
        return memory_metrics(*groups)

    def shutdown(self) -> None:
        """Stop every worker and release the placement group (a later run in this Ray session needs it)."""
        if self.judge_server is not None:
            self.judge_server.stop()
        for group in self._groups():
            group.shutdown()
        self.pool.remove()
        if self.rollout_pool is not None:
            self.rollout_pool.remove()


ROLE_CLASSES: dict[str, tuple[str, str]] = {
    "text": ("easyrl.workers.actor:ActorWorker", "easyrl.workers.ref:RefWorker"),
    "diffusion": ("easyrl.diffusion.actor:DenoiserActorWorker", "easyrl.diffusion.actor:DenoiserRefWorker"),
}
"""(actor, reference) worker classes by `RunPlan.modality`, beside `role_specs.ROLE_SPECS`; as import paths so a text
run never imports the denoiser's module. The denoiser's workers answer the LLM roles' calls: the rest is shared."""


LORA_TARGET_CHECKS: dict[str, str] = {
    "text": "easyrl.workers.lora:check_targets",
    "diffusion": "easyrl.diffusion.actor:check_lora_targets",
}
"""What checks `worker.actor.model.lora.target_modules` against the model on the driver, by `RunPlan.modality`: a
transformers config and a diffusers pipeline's transformer are built differently."""


def _load(path: str) -> Any:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def role_classes(modality: str) -> tuple[type, type]:
    """The (actor, reference) worker classes of `ROLE_CLASSES[modality]`."""
    actor, ref = ROLE_CLASSES[modality]
    return _load(actor), _load(ref)


def start_backend(
    cfg: EasyRLConfig, plan: RunPlan, slots: int, env: dict[str, str] | None
) -> tuple[Any, Callable[..., Any]]:
    """(the trainer's pool, the group class to start each role with) for the plan's backend: the one place that
    names it (`tests/test_structure.py`). `slots`: the workers of a CPU run (Ray's logical CPUs); `env`: what the
    engine needs in every worker. Both group classes take the same arguments and answer the same calls."""
    from easyrl.trainer.plan import Backend

    gpu = plan.use_gpu
    where = "GPU" if gpu else "CPU"
    if plan.backend is Backend.INLINE:
        from easyrl.distributed.inline import InlineGroup, InlinePool

        logger.info("workers in this process, one per role (%s; %s)", where, plan.backend_reason)
        return InlinePool(gpu, env), InlineGroup
    from easyrl.distributed import ResourcePool, WorkerGroup, init_ray

    logger.info("starting Ray and %d worker(s) per role (%s; %s)", plan.world_size, where, plan.backend_reason)
    init_ray(num_cpus=cfg.trainer.ray_num_cpus or max(slots, psutil.cpu_count() or 1), env_vars=env)
    return ResourcePool(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, gpu), WorkerGroup


def memory_metrics(*groups: GroupHandle | None) -> dict[str, float]:
    """The host's memory in use and the largest of each memory figure over the ranks of `groups` (None skipped)."""
    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    calls = [group.call_async("memory_stats") for group in groups if group is not None]
    for call in calls:
        per_worker = call.result()
        for stats in per_worker if isinstance(per_worker, list) else [per_worker]:
            for key, value in stats.items():
                out[key] = max(out.get(key, 0.0), value)
    return out


class SFTWorkers:
    """`easyrl sft`'s one worker group: the policy (`SFTWorker`), one worker per GPU (or CPU slot), named `actor`
    as the RL policy is (its checkpoints are the actor's)."""

    def __init__(self, cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int) -> None:
        from easyrl.trainer.role_specs import sft_spec
        from easyrl.workers.sft import SFTWorker

        if cfg.worker.actor.model.lora.rank > 0:  # target_modules is checked against the model before workers start
            from easyrl.workers.lora import check_targets

            check_targets(cfg.worker.actor.model)
        gpu = plan.use_gpu
        self.world_size = plan.world_size
        self.pool, group_cls = start_backend(cfg, plan, self.world_size, None)
        self.actor: SFTGroup  # set once its group starts (`shutdown` reads it only then)
        try:
            self.actor = group_cls(
                SFTWorker,
                self.pool,
                "actor",
                sft_spec(cfg, plan, optimizer_steps, self.world_size),
                ranks_per_dp=cfg.worker.actor.sp_size,
                num_cpus_per_worker=1.0,
                num_gpus_per_worker=1.0 if gpu else 0.0,
                call_timeout_s=cfg.trainer.worker_timeout_s,
                **hang_watch_args(cfg),
            )
            logger.info("loading the model into the workers")
            self.actor.call_async("init_model").result()
        except BaseException:
            self.shutdown()
            raise

    def memory_metrics(self) -> dict[str, float]:
        return memory_metrics(self.actor)

    def shutdown(self) -> None:
        """Stop the workers and release the placement group."""
        actor = getattr(self, "actor", None)  # unset when its group failed to start
        if actor is not None:
            actor.shutdown()
        self.pool.remove()


def build_workers(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, *datasets: Any) -> Workers:
    """The worker groups; ``datasets`` (train, validation) tell the rollout engine how many images and videos one
    prompt may carry."""
    if cfg.worker.actor.model.lora.rank > 0:  # target_modules is checked against the model before workers start
        check_targets: Callable[..., None] = _load(LORA_TARGET_CHECKS[plan.modality])
        check_targets(cfg.worker.actor.model)
    if plan.critic and cfg.worker.critic.model.lora.rank > 0:
        from easyrl.workers.lora import check_targets as check_critic_targets

        check_critic_targets(cfg.worker.critic.model, "worker.critic.model.lora")
    media: dict[str, int] = {}
    for data in datasets:
        if data is not None:
            for kind, count in data.media_per_row().items():
                media[kind] = max(media.get(kind, 0), count)
    return Workers(cfg, plan, optimizer_steps, media)
