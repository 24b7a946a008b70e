"""The denoiser's actor and reference roles: FSDP2 on the pipeline's transformer, LoRA as for LLMs, Flow-GRPO's loss.

Public names (stable; the trainer wiring builds the specs and calls the workers): `SamplerSettings`,
`DenoiserActorSpec`, `DenoiserRefSpec`, `DenoiserModel`, `load_denoiser`, `check_lora_targets`, `DenoiserActorWorker`,
`DenoiserRefWorker`, `denoiser_objective`.

The workers expose the LLM actor's interface to the trainer (`compute_log_probs`, `compute_ref_log_probs`,
`update_actor(batch, entropy_coeff)`, `save_checkpoint`/`load_checkpoint`, `full_weights`, `policy_version`), over the
batch fields `easyrl.diffusion.policy` names plus ``loss_mask`` (B, T: the trained steps, as for LLMs what the loss
counts; the engine writes it equal to ``response_mask``), ``advantages`` (B, T)
and, for the KL term, ``ref_means`` (B, T, C, H, W: the reference's step means, which `compute_ref_log_probs`
returns beside ``ref_log_probs``).

Only the transformer is here: the text encoders and the VAE never train, so the engine encodes prompts and decodes
images, and the workers see text features and latents. The update is the LLM actor's own loop (`update_model`:
mini-batches, micro-batches weighed by their share of the global token count, grad clipping, skipped non-finite
steps) with each denoising step as a token: the registered policy loss over the T steps with ``loss_mask``, plus
``kl_coef`` times the closed-form Gaussian KL of each step (`transition_kl`; ``kl_penalty`` does not apply: the two
steps' densities are known exactly). A Gaussian step's entropy is the schedule's alone, so there is no entropy bonus.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from easyrl.algorithms import agg_loss
from easyrl.batch import Batch
from easyrl.config.errors import ConfigError
from easyrl.config.worker import ModelConfig
from easyrl.diffusion import engine as _engine  # noqa: F401  (registers the `diffusers` engine this actor hosts)
from easyrl.diffusion.policy import transition_kl, transition_log_probs
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryLevers, MemoryReporting, peak_memory
from easyrl.models.dtypes import DTYPES
from easyrl.rollout import RolloutSpec, SamplingParams
from easyrl.rollout.worker import RolloutWorker
from easyrl.workers.actor import ResidentPolicy, policy_objective
from easyrl.workers.batching import sync_max
from easyrl.workers.forward_backward import LossFn, MicroBatchLoss, update_model
from easyrl.workers.model_setup import build_optimizer, build_scheduler, setup_process, shard_model
from easyrl.workers.session import OneCallSession
from easyrl.workers.specs import ModelSpec, PolicyLossSpec, ProcessSpec, UpdateSpec
from easyrl.workers.trainable import TrainableModel, TrainedRole


__all__ = [
    "DenoiserActorSpec",
    "DenoiserActorWorker",
    "DenoiserModel",
    "DenoiserRefSpec",
    "DenoiserRefWorker",
    "SamplerSettings",
    "check_lora_targets",
    "denoiser_objective",
    "load_denoiser",
]


@dataclass(frozen=True)
class SamplerSettings:
    """How the engine sampled: the update scores the recorded steps under the same guidance and noise."""

    guidance_scale: float
    """`worker.rollout.diffusion.guidance_scale`."""
    noise_level: float
    """`worker.rollout.diffusion.noise_level`."""


@dataclass(frozen=True)
class DenoiserActorSpec:
    process: ProcessSpec
    model: ModelSpec
    """``model.model.model_path`` is the diffusers pipeline folder; its ``transformer`` is loaded and trained."""
    update: UpdateSpec
    loss: PolicyLossSpec
    """The registered policy loss; with ``kl_in_loss``, ``kl_coef`` weighs the Gaussian KL (``kl_penalty`` unused)."""
    sampler: SamplerSettings
    micro_batch_size_for_experience: int
    """Samples per forward pass when scoring log-probs."""
    serves_reference: bool = False
    """LoRA with KL on: the actor scores the reference (its base, adapters off); no reference worker."""
    rollout: RolloutSpec | None = None
    """The `diffusers` engine this worker hosts (the LLM actor's HybridEngine); None: a worker that only trains."""
    memory_levers: MemoryLevers | None = None
    """What the engine names when it cannot wake for lack of GPU memory."""


@dataclass(frozen=True)
class DenoiserRefSpec:
    process: ProcessSpec
    model: ModelSpec
    sampler: SamplerSettings
    micro_batch_size_for_experience: int


def load_denoiser(model_cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The ``transformer`` of the local diffusers pipeline folder ``model_cfg.model_path``."""
    from diffusers import AutoModel

    path = _pipeline_folder(model_cfg)
    model: nn.Module = AutoModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
    return model


def check_lora_targets(model_cfg: ModelConfig) -> None:
    """On the driver, before any worker starts: LoRA applied to the denoiser built on the meta device from its
    config (no weights read), so `target_modules` matching nothing stops the run in one line, as for LLMs
    (`easyrl.workers.lora.check_targets`, which builds a transformers model and cannot read a diffusers config)."""
    import diffusers

    from easyrl.config.diffusion import read_config_json
    from easyrl.workers.lora import apply_lora

    config = read_config_json(os.path.join(_pipeline_folder(model_cfg), "transformer", "config.json"))
    # The class named in the config, not diffusers' AutoModel: its from_pretrained of a pipeline folder leaves
    # AutoModel.config_name at "model_index.json" (diffusers 0.42), and a later from_config reads the pipeline's.
    model_cls: Any = getattr(diffusers, str(config["_class_name"]))
    with torch.device("meta"):
        model = model_cls.from_config(config)
    apply_lora(model, model_cfg.lora)


def _pipeline_folder(model_cfg: ModelConfig) -> str:
    path = model_cfg.model_path
    if path is None or not os.path.isfile(os.path.join(path, "model_index.json")):
        raise ConfigError(
            "worker.actor.model.model_path",
            f"{path!r} is not a diffusers pipeline folder (no model_index.json); point it at one (a folder with "
            "model_index.json and a transformer/ subfolder)",
        )
    if not os.path.isdir(os.path.join(path, "transformer")):
        raise ConfigError(
            "worker.actor.model.model_path",
            f"{path} has no transformer/ folder: only transformer-based (flow-matching) pipelines train, not UNets",
        )
    return path


class DenoiserModel(TrainableModel):
    """`TrainableModel` for a pipeline's transformer: the same offload, weight streaming, LoRA reference and state
    sizes; only the build differs (diffusers loading, diffusers' gradient checkpointing)."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        model = load_denoiser(spec.model, DTYPES[spec.torch_dtype] if spec.torch_dtype else torch.float32)
        if not spec.trainable:
            model.requires_grad_(False)
        self.lora = spec.trainable and spec.model.lora.rank > 0
        if self.lora:
            from easyrl.workers.lora import apply_lora

            apply_lora(model, spec.model.lora)
        if spec.trainable and spec.model.enable_gradient_checkpointing:
            enable: Any = model.enable_gradient_checkpointing  # diffusers' own: non-reentrant
            enable()
        # One FSDP unit per transformer block (diffusers' `_no_split_modules`), then the root.
        self.module = shard_model(model, spec.fsdp, device, gradient_checkpointing=False)
        self.optimizer = None
        self.scheduler = None
        if spec.optim is not None:
            self.optimizer = build_optimizer(self.module, spec.optim)
            self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.total_optimizer_steps)
        else:
            self.module.eval()


def _sharded() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _forwards(batch: Batch) -> int:
    """The forwards each micro-batch runs: the most trained steps of any row on any rank (FSDP's collectives must
    match across ranks)."""
    local = int((batch["loss_mask"] > 0).sum(dim=1).max().item()) if len(batch) else 0
    return sync_max(local) if _sharded() else local


@torch.no_grad()
def _score(
    model: nn.Module, batch: Batch, settings: SamplerSettings, micro: int, device: torch.device, means: bool
) -> dict[str, torch.Tensor]:
    """Log-probs (B, T) of the trained steps, and their means (B, T, ...) when asked, on CPU, in micro-batches."""
    forwards = _forwards(batch)
    lps, mus = [], []
    for mb in batch.split(micro):
        on_device = mb.to(device)
        scores = transition_log_probs(
            model, on_device.tensors, settings.guidance_scale, settings.noise_level, on_device["loss_mask"],
            forwards,
        )  # fmt: skip
        lps.append(scores.log_probs.cpu())
        if means:
            mus.append(scores.means.cpu())
    out = {"log_probs": torch.cat(lps)}
    return out | {"means": torch.cat(mus)} if means else out


def denoiser_objective(
    mb: Batch, model: nn.Module, settings: SamplerSettings, spec: PolicyLossSpec, loss_agg_mode: str, forwards: int,
    policy_version: int | None = None,
) -> MicroBatchLoss:  # fmt: skip
    """One micro-batch's loss (on the model's device): the actor's policy objective over the trained steps, plus
    ``kl_coef`` x the aggregated Gaussian KL to ``ref_means`` when ``spec.kl_in_loss``."""
    mask = mb["loss_mask"].float()
    scores = transition_log_probs(
        model, mb.tensors, settings.guidance_scale, settings.noise_level, mask, forwards
    )  # (B, T) log-probs and (B, T, ...) means with the graph
    # The LLM objective with its own KL term off: ours is the closed-form one below.
    out = policy_objective(
        mb, scores.log_probs, None, dataclasses.replace(spec, kl_in_loss=False), loss_agg_mode, 0.0, None,
        policy_version,
    )  # fmt: skip
    if spec.kl_in_loss:
        kl = transition_kl(scores.means, mb["ref_means"], scores.stds)  # (B, T)
        kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=loss_agg_mode)
        out.loss = out.loss + spec.kl_coef * kl_loss
        out.terms["actor/kl_loss"] = kl_loss.detach()
    return out


class DenoiserActorWorker(TrainedRole, MemoryReporting, OneCallSession):
    """Trains the denoiser with Flow-GRPO's objective and samples with it: the `diffusers` engine in a
    `RolloutWorker` in this process, driven through the LLM actor's session calls (`open_rollout`, `generate`,
    `close_rollout`); under LoRA with KL on, also scores the reference."""

    def __init__(self, spec: DenoiserActorSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.rank = int(os.environ.get("RANK", "0"))
        self.ledger = MemoryLedger("actor", self.device, spec.memory_levers)

    @register(dispatch=Dispatch.ALL)
    def init_model(self, media_per_prompt: dict[str, int] | None = None) -> None:
        del media_per_prompt  # prompts carry no media: the engine encodes text only
        trainable = DenoiserModel(self.spec.model, self.device)
        assert trainable.optimizer is not None, "a trained role needs worker.actor.optim"
        self.trainable = trainable
        self.model, self.optimizer, self.scheduler = trainable.module, trainable.optimizer, trainable.scheduler
        self._policy_version = 0
        self.rollout: RolloutWorker | None = None
        if self.spec.rollout is not None:
            self.rollout = RolloutWorker(self.spec.rollout, self.device, self.ledger)
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # as the LLM actor: a lone rank may rebuild its engine
                self.rollout.rebuild_source = ResidentPolicy(self.trainable)

    # ---------------------------------------------------------------- rollout (the LLM actor's session calls)
    @property
    def engine_session(self) -> RolloutWorker:
        if self.rollout is None:
            raise RuntimeError("this denoiser actor hosts no engine (DenoiserActorSpec.rollout is None)")
        return self.rollout

    @register(dispatch=Dispatch.ALL_MERGED)
    def open_rollout(self) -> dict[str, float]:
        """Wake the engine and push the denoiser's weights when they changed since its last session (the training
        state leaves the device first); `timing_s/wake` (and `timing_s/update_weights` after a push)."""
        return self.engine_session.open(self.trainable, self._policy_version, make_room=self.trainable.offload)

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """`params.n` images per prompt (their trajectories, `easyrl.diffusion.engine`) with the weights the engine
        holds, each row stamped with their `policy_version`; no wake, sync or sleep here."""
        return self.engine_session.generate(prompts, params)

    @register(dispatch=Dispatch.ALL_MERGED)
    def close_rollout(self) -> dict[str, float]:
        """Put the engine to sleep and bring the training state back; `timing_s/sleep`."""
        timing = self.engine_session.close()
        self.trainable.reload()
        return timing

    def after_load_checkpoint(self) -> None:
        """The engine still holds the weights of before the load: push the restored ones at the next session."""
        if self.rollout is not None:
            self.rollout.stale = True

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("old")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The denoiser's log-prob (B, T) of each trained step before the update (0 on the untrained ones)."""
        self.model.eval()
        spec = self.spec
        out = _score(self.model, batch, spec.sampler, spec.micro_batch_size_for_experience, self.device, False)
        return Batch({"old_log_probs": out["log_probs"]})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref")
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """LoRA: the base denoiser's (adapters off) ``ref_log_probs`` (B, T) and ``ref_means`` (B, T, ...)."""
        assert self.spec.serves_reference, "only a LoRA actor with KL on serves the reference"
        self.model.eval()
        spec = self.spec
        with self.trainable.as_reference():
            out = _score(self.model, batch, spec.sampler, spec.micro_batch_size_for_experience, self.device, True)
        return Batch({"ref_log_probs": out["log_probs"], "ref_means": out["means"]})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("update")
    def update_actor(self, batch: Batch, entropy_coeff: float) -> dict[str, float]:
        """Flow-GRPO update over the batch; returns `actor/*` metrics (global values, averaged over mini-batches)."""
        if entropy_coeff != 0:
            raise ValueError(
                f"entropy_coeff={entropy_coeff}: a denoising step's entropy is fixed by the noise schedule, so the "
                "bonus has no gradient; set worker.actor.entropy_coeff: 0 for diffusion"
            )
        if "old_log_probs" not in batch and (
            self.spec.update.epochs != 1 or len(batch) > self.spec.update.mini_batch_size
        ):
            raise ValueError(
                "update_actor without old_log_probs needs one epoch over one mini-batch "
                f"(worker.actor.ppo_epochs={self.spec.update.epochs}, {len(batch)} rows): run compute_log_probs first"
            )
        self.model.train()
        forwards = _forwards(batch)
        spec, mode, version = self.spec, self.spec.update.loss_avg_mode, self._policy_version

        def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
            return denoiser_objective(on_device, self.model, spec.sampler, spec.loss, mode, forwards, version)

        fn: LossFn = loss_fn
        metrics = update_model(self.trainable, batch, spec.update, fn, prefix="actor")
        if spec.loss.kl_in_loss:
            metrics["actor/kl_coef"] = spec.loss.kl_coef
        metrics |= self.trainable.state_sizes()
        self._policy_version += 1
        if self.rollout is not None:  # the next session pushes the new weights
            self.rollout.stale = True
        return metrics

    @register(dispatch=Dispatch.RANK0)
    def policy_version(self) -> int:
        """The `update_actor` calls the weights reflect."""
        return self._policy_version

    @register(dispatch=Dispatch.ALL)
    def set_policy_version(self, version: int) -> None:
        """A resumed run's policy version."""
        self._policy_version = version

    @register(dispatch=Dispatch.RANK0)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole transformer (LoRA merged) as CPU tensors on rank 0, under diffusers' names: what the engine
        loads (every rank joins the gathers)."""
        weights = {name: t.cpu().clone() for name, t in self.trainable.full_weights(aliases=True)}
        return weights if self.rank == 0 else None

    def checkpoint_sources(self) -> tuple[str | None, str | None]:
        return None, None  # a pipeline has no tokenizer at its root; the config is the transformer's own


class DenoiserRefWorker(MemoryReporting):
    """The frozen base denoiser (a separate copy: full fine-tuning), off the device between its passes."""

    def __init__(self, spec: DenoiserRefSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger("ref", self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.trainable = DenoiserModel(self.spec.model, self.device)
        self.trainable.offload()

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref", release=True)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The base denoiser's ``ref_log_probs`` (B, T) and ``ref_means`` (B, T, ...) of the trained steps."""
        spec = self.spec
        with self.trainable.resident():
            out = _score(
                self.trainable.module, batch, spec.sampler, spec.micro_batch_size_for_experience, self.device, True
            )
        return Batch({"ref_log_probs": out["log_probs"], "ref_means": out["means"]})
