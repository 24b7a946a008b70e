"""The driver's half of the worker contract: one frozen spec per role, built once from the validated config and
the run plan decided from it (`easyrl.trainer.plan`: device, placement, weight sync, sleep level, passes).

Everything a worker needs that depends on another section (the reference and the critic follow the actor's
forward settings, the rollout engine loads the actor's model, the per-rank mini-batch depends on `rollout.n` and
the world size) is resolved here, so that no worker reads a section other than its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from easyrl.algorithms import policy_loss_params
from easyrl.config import EasyRLConfig
from easyrl.config.algorithm import KLMode
from easyrl.config.engine_kwargs import sequences_per_engine_call
from easyrl.config.worker import ActorConfig, CriticConfig, ModelConfig
from easyrl.distributed.memory import MemoryLevers
from easyrl.rollout import RolloutSpec, SamplingParams
from easyrl.trainer.plan import RunPlan
from easyrl.trainer.step_math import OldPass
from easyrl.workers.specs import (
    ActorSpec,
    CriticSpec,
    EmbedsSpec,
    ForwardOptions,
    ModelSpec,
    PolicyLossSpec,
    ProcessSpec,
    RefSpec,
    RolloutRoleSpec,
    SFTSpec,
    TeacherSpec,
    UpdateSpec,
)


if TYPE_CHECKING:
    from easyrl.diffusion.actor import DenoiserActorSpec, DenoiserRefSpec


@dataclass(frozen=True)
class RoleSpecs:
    actor: ActorSpec | DenoiserActorSpec
    """A diffusion run's is the denoiser's (`easyrl.diffusion.actor`): `ROLE_SPECS` picks by `RunPlan.modality`."""
    ref: RefSpec | DenoiserRefSpec | None
    """None when KL is off (no reference model), or with LoRA (the actor's base, adapters off, is the reference)."""
    critic: CriticSpec | None
    """None unless the advantage estimator needs a critic."""
    teacher: TeacherSpec | None = None
    """None unless `algorithm.distill.teacher` is a local checkpoint (a remote one is the driver's client)."""


def build_role_specs(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, world_size: int) -> RoleSpecs:
    """The spec of every role `plan` starts, by the run's modality (`ROLE_SPECS`). `optimizer_steps`: the actor's
    optimizer steps over the run. The update levers `easyrl train` left on auto are decided already
    (`easyrl.update_levers.resolve_update_levers`); one still null is read as today's default (see each reader)."""
    return ROLE_SPECS[plan.modality](cfg, plan, optimizer_steps, world_size)


def _text_role_specs(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, world_size: int) -> RoleSpecs:
    """An LLM run's roles: a reference when KL is on (without LoRA), a critic when the advantage estimator declared
    it needs one, a local teacher."""
    process = process_spec(cfg, plan)
    ref = None
    if plan.ref_worker:
        ref_micro = cfg.worker.ref.micro_batch_size_per_device_for_experience
        ref = RefSpec(
            process=process,
            model=ModelSpec(
                model=cfg.worker.actor.model,
                torch_dtype=cfg.worker.ref.fsdp.torch_dtype,
                fsdp=cfg.worker.ref.fsdp,
                offload=cfg.worker.ref.offload,
                forward=forward_options(cfg, plan),
                embeds=embeds_spec(cfg),
            ),
            temperature=cfg.worker.rollout.temperature,
            micro_batch_size_for_experience=ref_micro or cfg.worker.actor.micro_batch_size_per_device_for_experience,
        )
    critic = _critic_spec(cfg, plan, process, optimizer_steps, world_size) if plan.critic else None
    teacher = _teacher_spec(cfg, plan, process) if plan.teacher_worker else None
    return RoleSpecs(
        actor=_actor_spec(cfg, plan, process, optimizer_steps, world_size), ref=ref, critic=critic, teacher=teacher
    )


def _denoiser_role_specs(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, world_size: int) -> RoleSpecs:
    """A diffusion run's roles: the denoiser's actor hosting the `diffusers` engine, and with KL on (without LoRA)
    the frozen base denoiser as reference; no critic, no teacher (`config` refuses them for a pipeline)."""
    from easyrl.diffusion.actor import DenoiserActorSpec, DenoiserRefSpec, SamplerSettings

    acfg, alg, diffusion = cfg.worker.actor, cfg.algorithm, cfg.worker.rollout.diffusion
    process = process_spec(cfg, plan)
    sampler = SamplerSettings(guidance_scale=diffusion.guidance_scale, noise_level=diffusion.noise_level)
    micro = acfg.micro_batch_size_per_device_for_experience
    ref = None
    if plan.ref_worker:
        rcfg = cfg.worker.ref
        ref = DenoiserRefSpec(
            process=process,
            model=ModelSpec(model=acfg.model, torch_dtype=rcfg.fsdp.torch_dtype, fsdp=rcfg.fsdp, offload=rcfg.offload),
            sampler=sampler,
            micro_batch_size_for_experience=rcfg.micro_batch_size_per_device_for_experience or micro,
        )
    actor = DenoiserActorSpec(
        process=process,
        model=_policy_model_spec(cfg, plan, optimizer_steps),
        update=_update_spec(acfg, cfg.worker.rollout.n, world_size),
        loss=PolicyLossSpec(
            loss_type=acfg.loss_type,
            params=policy_loss_params(acfg.loss_type, acfg),
            kl_in_loss=alg.kl_mode == KLMode.IN_LOSS,
            kl_penalty=alg.kl_penalty,  # unused: the denoiser's KL is the closed-form Gaussian one
            kl_coef=alg.kl_coef,
        ),
        sampler=sampler,
        micro_batch_size_for_experience=micro,
        serves_reference=plan.ref_log_probs and not plan.ref_worker,
        rollout=rollout_spec(cfg, plan),
        memory_levers=memory_levers(cfg),
    )
    return RoleSpecs(actor=actor, ref=ref, critic=None)


ROLE_SPECS: dict[str, Callable[[EasyRLConfig, RunPlan, int, int], RoleSpecs]] = {
    "text": _text_role_specs,
    "diffusion": _denoiser_role_specs,
}
"""The roles' specs of a run by `RunPlan.modality`: the one place the trainer's wiring tells them apart (with
`worker_groups.ROLE_CLASSES` and `reward_inputs`)."""


def _teacher_spec(cfg: EasyRLConfig, plan: RunPlan, process: ProcessSpec) -> TeacherSpec:
    """The teacher: its own checkpoint, frozen, sharded and offloaded as the reference, with the actor's forward
    settings (the same layout of the same token ids) and the rollout's temperature (as the student's log-probs)."""
    ref_cfg, teacher = cfg.worker.ref, cfg.algorithm.distill.teacher
    micro = ref_cfg.micro_batch_size_per_device_for_experience
    return TeacherSpec(
        process=process,
        model=ModelSpec(
            model=ModelConfig(
                model_path=teacher.model_path,
                tokenizer_path=teacher.tokenizer_path,
                trust_remote_code=teacher.trust_remote_code,
                enable_gradient_checkpointing=False,  # no backward pass
            ),
            torch_dtype=ref_cfg.fsdp.torch_dtype,
            fsdp=ref_cfg.fsdp,
            offload=ref_cfg.offload,
            forward=forward_options(cfg, plan),
        ),
        temperature=cfg.worker.rollout.temperature,
        micro_batch_size_for_experience=micro or cfg.worker.actor.micro_batch_size_per_device_for_experience,
        top_k=cfg.algorithm.distill.top_k if cfg.algorithm.distill.mode == "topk_fkl" else 0,
    )


def _policy_model_spec(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int) -> ModelSpec:
    """The policy's model as the actor (RL) and the SFT worker train it: its checkpoint, FSDP, optimizer, offload and
    forward settings."""
    acfg = cfg.worker.actor
    return ModelSpec(
        model=acfg.model,
        torch_dtype=acfg.fsdp.torch_dtype,
        fsdp=acfg.fsdp,
        optim=acfg.optim,
        offload=acfg.offload,
        forward=forward_options(cfg, plan),
        total_optimizer_steps=optimizer_steps,
        checkpoint_files=_checkpoint_files(acfg.model, acfg.model),
        embeds=embeds_spec(cfg),
    )


def embeds_spec(cfg: EasyRLConfig) -> EmbedsSpec:
    """The vision tower's output cache of every role that scores the policy's samples (`data.cache_dir`)."""
    data = cfg.data
    settings = (
        ("video_fps", float(data.video_fps)),
        ("max_frames", float(data.max_frames)),
        ("min_pixels", float(data.min_pixels)),
        ("max_pixels", float(data.max_pixels)),
    )
    return EmbedsSpec(cache_dir=data.cache_dir, max_gb=data.cache_max_gb, settings=settings)


def _actor_spec(
    cfg: EasyRLConfig, plan: RunPlan, process: ProcessSpec, optimizer_steps: int, world_size: int
) -> ActorSpec:
    acfg, alg = cfg.worker.actor, cfg.algorithm
    return ActorSpec(
        process=process,
        model=_policy_model_spec(cfg, plan, optimizer_steps),
        update=_update_spec(acfg, cfg.worker.rollout.n, world_size),
        loss=PolicyLossSpec(
            loss_type=acfg.loss_type,
            params=policy_loss_params(acfg.loss_type, acfg),  # only the knobs this loss registered
            kl_in_loss=alg.kl_mode == KLMode.IN_LOSS,
            kl_penalty=alg.kl_penalty,
            kl_coef=alg.kl_coef,
            distill_topk_coef=alg.distill.coef if alg.distill.enabled and alg.distill.mode == "topk_fkl" else 0.0,
            measures_engine=not plan.old_log_prob_pass.before_update,
        ),
        rollout=rollout_spec(cfg, plan),
        temperature=cfg.worker.rollout.temperature,
        micro_batch_size_for_experience=acfg.micro_batch_size_per_device_for_experience,
        memory_levers=memory_levers(cfg),
        serves_reference=plan.ref_log_probs and not plan.ref_worker,  # a LoRA actor's base, adapters off
        colocated_engine=not plan.separate,
        old_from_first_forward=plan.old_log_prob_pass is OldPass.AFTER_FIRST_MINI_BATCH,
    )


def sft_spec(cfg: EasyRLConfig, plan: RunPlan, optimizer_steps: int, world_size: int) -> SFTSpec:
    """The spec of `easyrl sft`'s one role: the actor's model, optimizer, FSDP and forward settings, one response
    per row (`global_batch_size` rows an optimizer step)."""
    acfg = cfg.worker.actor
    return SFTSpec(
        process=process_spec(cfg, plan),
        model=_policy_model_spec(cfg, plan, optimizer_steps),
        update=_update_spec(acfg, 1, world_size),
        micro_batch_size_for_experience=acfg.micro_batch_size_per_device_for_experience,
    )


def memory_levers(cfg: EasyRLConfig) -> MemoryLevers:
    """The settings a failed engine wake names as the ways to make room, with this run's values."""
    acfg = cfg.worker.actor
    return MemoryLevers(
        gpu_memory_utilization=cfg.worker.rollout.gpu_memory_utilization,
        actor_offload_params=acfg.offload.offload_params,
        actor_offload_optimizer=acfg.offload.offload_optimizer,
        ref_offload_params=cfg.worker.ref.offload.offload_params,
        actor_max_token_len_per_gpu=acfg.max_token_len_per_gpu,
    )


def _critic_spec(
    cfg: EasyRLConfig, plan: RunPlan, process: ProcessSpec, optimizer_steps: int, world_size: int
) -> CriticSpec:
    ccfg, acfg = cfg.worker.critic, cfg.worker.actor
    # The critic makes global/critic-global times the actor's optimizer steps per step.
    critic_steps = optimizer_steps // acfg.global_batch_size * ccfg.global_batch_size
    # The critic follows the actor's packing and token budget (no fused head: one output), with its own split.
    return CriticSpec(
        process=process,
        model=ModelSpec(
            model=ccfg.model,
            kind="value",
            torch_dtype=ccfg.fsdp.torch_dtype,
            fsdp=ccfg.fsdp,
            optim=ccfg.optim,
            offload=ccfg.offload,
            forward=ForwardOptions(
                padding_free=plan.padding_free,
                max_token_len=acfg.max_token_len_per_gpu * ccfg.ulysses_size if acfg.dynamic_batching else None,
                ulysses_size=ccfg.ulysses_size,
            ),
            total_optimizer_steps=max(critic_steps, 1),
            checkpoint_files=_checkpoint_files(ccfg.model, acfg.model),
        ),
        update=_update_spec(ccfg, cfg.worker.rollout.n, world_size),
        cliprange_value=ccfg.cliprange_value,
        micro_batch_size_for_experience=ccfg.micro_batch_size_per_device_for_experience,
    )


def _update_spec(wcfg: ActorConfig | CriticConfig, n: int, world_size: int) -> UpdateSpec:
    """Per-rank sizes: `config.validate` checked that global_batch_size * n divides over the data-parallel groups
    (the ranks of a sequence-parallel group hold the same samples)."""
    return UpdateSpec(
        mini_batch_size=wcfg.global_batch_size * n // (world_size // wcfg.sp_size),
        micro_batch_size=wcfg.micro_batch_size_per_device_for_update,
        epochs=wcfg.ppo_epochs,
        max_grad_norm=wcfg.max_grad_norm,
        loss_avg_mode=wcfg.loss_avg_mode,
        # the critic reduces per micro-batch: the lever is the actor's (`worker.actor.defer_gradient_sync`)
        defer_gradient_sync=isinstance(wcfg, ActorConfig) and wcfg.defer_gradient_sync is True,
    )


def _checkpoint_files(own: ModelConfig, actor: ModelConfig) -> tuple[str | None, str | None]:
    """(model folder, tokenizer folder) for a checkpoint's `huggingface/` files: the role's own, else the actor's."""
    model_path = own.model_path or actor.model_path
    return model_path, own.tokenizer_path or actor.tokenizer_path or model_path


def process_spec(cfg: EasyRLConfig, plan: RunPlan) -> ProcessSpec:
    """What every worker process sets up first: its seed, the user's modules, its CPU threads."""
    return ProcessSpec(
        seed=cfg.trainer.seed, user_modules=tuple(cfg.algorithm.user_modules), cpu_threads=cpu_threads(cfg, plan)
    )


def cpu_threads(cfg: EasyRLConfig, plan: RunPlan, cores: int | None = None) -> int:
    """torch threads per CPU worker: a node's cores (`node_cores`) shared among the workers that run at once on it,
    at least 1. `EASYRL_NUM_THREADS` overrides it.

    Roles of one worker slot (actor, reference, critic) take turns, so they share the slot's threads; rollout workers
    of their own (`placement: separate`) run beside the actors and take slots of their own. On the 2-core demo one
    worker of 2 threads trains as fast as two workers of 1 (docs/benchmarks.md, issue 29)."""
    if "EASYRL_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["EASYRL_NUM_THREADS"]))
    per_node = cfg.trainer.n_gpus_per_node + plan.own_rollout_workers
    return max(1, (node_cores(cfg) if cores is None else cores) // max(1, per_node))


def node_cores(cfg: EasyRLConfig) -> int:
    """The cores one node's workers share: the cores this process may run on, fewer where `trainer.ray_num_cpus` or a
    running Ray instance's smallest node (with CPUs) says so. Ray's logical CPUs alone can overstate the machine (the
    tests start a private instance with 4 on 2 cores), and the driver's machine alone a cluster's nodes (a local
    two-node cluster of one CPU each)."""
    counts = [len(os.sched_getaffinity(0))]
    if cfg.trainer.ray_num_cpus:
        counts.append(cfg.trainer.ray_num_cpus)
    ray = sys.modules.get("ray")  # only a started instance is asked: importing Ray here would slow `easyrl check`
    if ray is not None and ray.is_initialized():
        nodes = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")]
        counts += [int(cpus) for cpus in nodes if cpus >= 1]
    return max(1, min(counts))


def forward_options(cfg: EasyRLConfig, plan: RunPlan) -> ForwardOptions:
    """`ForwardOptions` from `worker.actor` (the reference follows all of them, the critic all but its split), with
    `padding_free` resolved for this run's device. The token budget is per rank: a sequence-parallel group's
    micro-batch holds `ulysses_size x ring_size` times as many tokens."""
    actor_cfg = cfg.worker.actor
    budget = actor_cfg.max_token_len_per_gpu * actor_cfg.sp_size
    forward_only = actor_cfg.log_prob_max_token_len_per_gpu  # None (not resolved): the update's budget
    return ForwardOptions(
        padding_free=plan.padding_free,
        fused=actor_cfg.fused_logprobs,
        chunk_size=actor_cfg.logprob_chunk_size,
        head_kernel=actor_cfg.fused_head_kernel,
        max_token_len=budget if actor_cfg.dynamic_batching else None,
        ulysses_size=actor_cfg.ulysses_size,
        ring_size=actor_cfg.ring_size,
        log_prob_max_token_len=forward_only * actor_cfg.sp_size if forward_only is not None else None,
    )


def rollout_spec(cfg: EasyRLConfig, plan: RunPlan) -> RolloutSpec:
    """The rollout engine's spec: the actor's model, the rollout section, and what the data bounds."""
    rcfg = cfg.worker.rollout
    return RolloutSpec(
        config=rcfg,
        model=cfg.worker.actor.model,
        # the carry-over loop's last call for a response may ask up to `chunk_tokens - 1` tokens past its end
        max_model_len=rcfg.max_model_len
        or cfg.data.max_prompt_length
        + cfg.data.max_response_length
        + (plan.chunk_tokens - 1 if plan.schedule == "carry_over" else 0),
        logprob_ratio=plan.logprob_ratio,
        weight_sync=plan.weight_sync,
        sleep_level=plan.sleep_level,  # an explicit level, else the one `weight_sync` implies
        sequences_per_call=sequences_per_engine_call(cfg),
    )


def sampling_params(cfg: EasyRLConfig, plan: RunPlan) -> SamplingParams:
    """The training sampling of `worker.rollout` (`n` responses per prompt); the trainer seeds each call. The
    engine's log-probs are asked for whenever the plan's `logprob_ratio` is above 0: a rollout correction or bypass
    mode reads them (ratio 1), and otherwise the engine-vs-actor figures (`rollout/token_prob_error`,
    `rollout/logprob_diff_*`) do, measured against the old-log-prob pass or, without it, the update's own forward.
    `worker.rollout.logprob_sample_ratio: 0` asks for none."""
    rcfg = cfg.worker.rollout
    return SamplingParams(
        logprobs=plan.logprob_ratio > 0,
        n=rcfg.n,
        temperature=rcfg.temperature,
        top_p=rcfg.top_p,
        top_k=rcfg.top_k,
        max_tokens=cfg.data.max_response_length,
        ignore_eos=rcfg.ignore_eos,
        stop_token_ids=tuple(rcfg.stop_token_ids),
    )


def _denoiser_validation(cfg: EasyRLConfig) -> dict[str, Any]:
    diffusion = cfg.worker.rollout.diffusion
    return {"denoising_steps": diffusion.val_num_steps or diffusion.num_steps}


VALIDATION_SAMPLING: dict[str, Callable[[EasyRLConfig], dict[str, Any]]] = {
    "text": lambda cfg: {},
    "diffusion": _denoiser_validation,
}
"""What validation samples differently by `RunPlan.modality`: a diffusion run's denoising steps are `val_num_steps`
(null: `num_steps`)."""


def validation_sampling(cfg: EasyRLConfig, plan: RunPlan) -> dict[str, Any]:
    """What validation changes in the training sampling, before `worker.rollout.val_override_config`: no engine
    log-probs (nothing compares validation samples with the trainer, and they cost generation speed), and what the
    modality adds (`VALIDATION_SAMPLING`)."""
    return {"logprobs": False, **VALIDATION_SAMPLING[plan.modality](cfg)}


def rollout_role_spec(actor: ActorSpec | DenoiserActorSpec) -> RolloutRoleSpec:
    """The spec of a worker that only generates, with the actor's engine settings (the same checkpoint, sampling
    engine, memory and weight sync), for rollouts in processes apart from the policy."""
    assert actor.rollout is not None and actor.memory_levers is not None, "the trainer's actor specs name an engine"
    return RolloutRoleSpec(process=actor.process, rollout=actor.rollout, memory_levers=actor.memory_levers)
