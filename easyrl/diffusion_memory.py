"""The memory plan of a diffusion run, per GPU: pure arithmetic over the pipeline's configs, printed by `easyrl check`.

Estimates, in bytes, of what one GPU holds (the counterpart of `easyrl.memory_plan` for a denoiser):

- the denoiser's training state, sharded over the ranks by FSDP2: master weights (``fsdp.torch_dtype``, fp32 when
  unset), gradients in the same dtype and AdamW's two moments (bf16 with ``optim.strategy: adamw_bf16``) of what
  trains (every weight, or under LoRA the adapters alone, counted as nothing); none on the GPU with
  ``fsdp.enable_cpu_offload``;
- activations of one update micro-batch: ``micro_batch_size_per_device_for_update`` samples, twice that under
  classifier-free guidance (the conditional and unconditional branches go through the denoiser as one batch), of S
  tokens each (latent patches of every latent frame plus the text tokens of the joint attention), in
  ``mp_param_dtype``. The update differentiates one denoising step at a time (each trained step's loss is backed
  before the next step's forward, as Flow-GRPO does), so the T steps of a trajectory never hold activations at once:
  with gradient checkpointing each layer's input (L x S x H) plus one layer's working set S x 14H (norms, q/k/v, the
  attention output and a 4H MLP's two halves); without it, that working set for every layer;
- the sampler's copy of the denoiser (gathered in ``worker.rollout.dtype``) and the frozen text encoders and VAE in
  the same dtype, resident while sampling; the batch's latents, B x (T + 1) x C x h x w in fp32;
- the reference denoiser (KL on, no LoRA: LoRA's reference is the base with the adapters off), sharded like the
  actor's weights; a CUDA context per process and NCCL's buffers with several ranks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from easyrl.config.diffusion import pipeline_geometry, read_config_json
from easyrl.memory_plan import CUDA_CONTEXT_BYTES, DTYPE_BYTES, NCCL_BYTES, GiB


@dataclass(frozen=True)
class PipelineShape:
    """What sets a pipeline's memory: its denoiser's size and geometry, and its frozen components' sizes."""

    name: str
    denoiser_params: int
    hidden_size: int
    num_layers: int
    latent_channels: int
    spatial: int
    temporal: int | None
    patch: int
    frozen_params: dict[str, int]

    @classmethod
    def from_folder(cls, path: str) -> PipelineShape:
        """Read from the configs alone (the models are built on the meta device: no weight is read)."""
        name, spatial, temporal, patch = pipeline_geometry(path)
        index = read_config_json(os.path.join(path, "model_index.json"))
        frozen: dict[str, int] = {}
        denoiser: dict[str, Any] = {}
        params = 0
        for part, spec in index.items():
            if part.startswith("_") or not isinstance(spec, list) or None in spec:
                continue
            folder = os.path.join(path, part)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                continue  # tokenizers and schedulers hold no weights
            count = _meta_parameter_count(str(spec[0]), str(spec[1]), folder)
            if part == "transformer":
                params, denoiser = count, read_config_json(os.path.join(folder, "config.json"))
            else:
                frozen[part] = count
        heads = int(str(denoiser.get("num_attention_heads", 1)))
        hidden = heads * int(str(denoiser.get("attention_head_dim", 64)))
        channels = int(str(denoiser.get("in_channels", 16)))
        return cls(name, params, hidden, int(str(denoiser.get("num_layers", 1))), channels, spatial, temporal, patch,
                   frozen)  # fmt: skip


def _meta_parameter_count(library: str, class_name: str, folder: str) -> int:
    """Parameters of the model class `class_name` of `library` configured by `folder`, built on the meta device."""
    import importlib

    import torch

    cls = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        if library == "diffusers":
            model = cls.from_config(cls.load_config(folder))
        else:
            model = cls(cls.config_class.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class DiffusionMemory:
    """One GPU's plan (bytes) at its two moments: sampling and the update."""

    device_total: int
    training_state: int
    activations: int
    sampler_weights: int
    frozen: int
    latents: int
    reference: int
    per_process: int

    @property
    def sampling(self) -> int:
        return self.training_state + self.sampler_weights + self.frozen + self.latents + self.per_process

    @property
    def updating(self) -> int:
        return self.training_state + self.activations + self.reference + self.frozen + self.latents + self.per_process


def tokens_per_sample(shape: PipelineShape, cfg: Any) -> int:
    """Denoiser tokens of one sample: latent patches of every latent frame, plus the text tokens."""
    diff = cfg.worker.rollout.diffusion
    step = shape.spatial * shape.patch
    frames = 1 if shape.temporal is None else (diff.num_frames - 1) // shape.temporal + 1
    # SD3's joint attention holds CLIP's 77 tokens beside T5's; a cross-attention model (Wan) is counted the same.
    return (diff.height // step) * (diff.width // step) * frames + diff.max_sequence_length + 77


def plan_diffusion_memory(shape: PipelineShape, cfg: Any, device_total: int) -> DiffusionMemory:
    """The per-GPU plan of the diffusion run `cfg` (an `EasyRLConfig`) on GPUs of `device_total` bytes."""
    w, diff = cfg.worker, cfg.worker.rollout.diffusion
    actor = w.actor
    ranks = max(1, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)
    master = DTYPE_BYTES[actor.fsdp.torch_dtype or "fp32"]
    moments = 2 * (DTYPE_BYTES["bf16"] if actor.optim.strategy == "adamw_bf16" else master)
    trained = 0 if actor.model.lora.rank else shape.denoiser_params
    state = math.ceil(shape.denoiser_params / ranks) * master + math.ceil(trained / ranks) * (master + moments)
    if actor.fsdp.enable_cpu_offload:
        state = 0
    act = DTYPE_BYTES[actor.fsdp.mp_param_dtype]
    tokens = tokens_per_sample(shape, cfg) * actor.micro_batch_size_per_device_for_update
    tokens *= 2 if diff.guidance_scale > 1 else 1
    layer = tokens * 14 * shape.hidden_size * act
    if actor.model.enable_gradient_checkpointing is not False:  # null (auto) keeps it on for a denoiser
        activations = shape.num_layers * tokens * shape.hidden_size * act + layer
    else:
        activations = shape.num_layers * layer
    engine = DTYPE_BYTES[w.rollout.dtype]
    frozen = sum(shape.frozen_params.values()) * engine
    samples = cfg.data.rollout_batch_size * w.rollout.n // ranks
    step = shape.spatial
    frames = 1 if shape.temporal is None else (diff.num_frames - 1) // shape.temporal + 1
    latents = samples * (diff.num_steps + 1) * shape.latent_channels * frames * (diff.height // step)
    latents *= (diff.width // step) * 4
    kl_on = not cfg.algorithm.disable_kl and cfg.algorithm.use_kl_loss
    ref_bytes = DTYPE_BYTES[w.ref.fsdp.torch_dtype or "fp32"]
    reference = math.ceil(shape.denoiser_params / ranks) * ref_bytes if kl_on and not actor.model.lora.rank else 0
    per_process = CUDA_CONTEXT_BYTES + (NCCL_BYTES if ranks > 1 else 0)
    return DiffusionMemory(device_total, state, activations, shape.denoiser_params * engine, frozen, latents,
                           reference, per_process)  # fmt: skip


def _g(value: int) -> str:
    return f"{value / GiB:.1f}"


def diffusion_plan_lines(shape: PipelineShape, plan: DiffusionMemory, cfg: Any) -> list[str]:
    """The plan as `easyrl check` prints it."""
    frozen = ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in shape.frozen_params.items())
    total = _g(plan.device_total)
    return [
        f"denoiser: {shape.denoiser_params / 1e9:.2f}B parameters ({shape.name}); frozen: {frozen}; "
        f"device: {total} GiB",
        f"tokens per sample: {tokens_per_sample(shape, cfg)} at {cfg.worker.rollout.diffusion.height}x"
        f"{cfg.worker.rollout.diffusion.width}x{cfg.worker.rollout.diffusion.num_frames}",
        f"training state (FSDP2 shard): {_g(plan.training_state)} GiB; activations (one micro-batch, one step): "
        f"{_g(plan.activations)} GiB; reference: {_g(plan.reference)} GiB",
        f"sampler's denoiser: {_g(plan.sampler_weights)} GiB; text encoders and VAE: {_g(plan.frozen)} GiB; "
        f"latents: {_g(plan.latents)} GiB",
        f"while sampling: {_g(plan.sampling)} of {total} GiB; while updating: {_g(plan.updating)} of {total} GiB",
    ]


def diffusion_plan_problems(plan: DiffusionMemory) -> list[str]:
    """Why the plan does not fit, with the settings that shrink it (empty: it fits)."""
    problems = []
    for moment, need in (("sampling", plan.sampling), ("updating", plan.updating)):
        if need > plan.device_total:
            problems.append(
                f"while {moment} one GPU needs ~{_g(need)} GiB of {_g(plan.device_total)}: lower "
                "worker.actor.micro_batch_size_per_device_for_update or the resolution, enable "
                "worker.actor.model.enable_gradient_checkpointing or worker.actor.fsdp.enable_cpu_offload, use LoRA "
                "(worker.actor.model.lora.rank), or add GPUs"
            )
    return problems
