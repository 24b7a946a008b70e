"""`TrainableModel`: one role's model as every role builds it, from its `ModelSpec` alone.

The chain is the same for the policy, the reference and the critic: load dtype, attention implementation (varlen
for padding-free), load the Hugging Face model, FSDP2-shard it, then (trained roles) the optimizer and LR schedule.
Offload / reload move what the role's `offload` section names between the accelerator and the host, and
`full_weights` streams the unsharded tensors to a rollout engine. Model-level features (adapters, sequence
parallelism) belong here, so every role gets them the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from easyrl.checkpoint import CheckpointMixin
from easyrl.config.errors import ConfigError
from easyrl.models.dtypes import DTYPES
from easyrl.models.embed_cache import EmbedCache, tower_version
from easyrl.models.linear_attention import SEQUENCE_PARALLEL_REFUSAL, linear_attention_layers
from easyrl.models.vision import is_vision_language, vision_tower
from easyrl.models.vl_embeds import embed_reuse_of, install_embed_reuse, tower_settings
from easyrl.workers.model_setup import (
    build_optimizer,
    build_scheduler,
    iter_full_weights,
    load_model,
    load_to_device,
    offload_to_cpu,
    shard_model,
)
from easyrl.workers.packing import packed_attn_implementation
from easyrl.workers.specs import EmbedsSpec, ModelSpec
from easyrl.workers.ulysses import enable_sequence_parallel


logger = logging.getLogger(__name__)


def tower_compute_dtype(spec: ModelSpec, device: torch.device) -> str:
    """The dtype the vision tower computes in: FSDP's mixed-precision parameter dtype on GPUs, fp32 on CPU (part
    of every cache key: a bf16 encoding is not an fp32 one)."""
    return spec.fsdp.mp_param_dtype if device.type == "cuda" else "fp32"


def _reuse_tower_outputs(model: nn.Module, embeds: EmbedsSpec, compute_dtype: str) -> None:
    """One vision-tower encoding per media item (`easyrl.models.vl_embeds`); a frozen tower's outputs are also
    reused across passes and cached on disk (its weights version is hashed here, before sharding: full tensors)."""
    tower = vision_tower(model) if is_vision_language(model) else None
    if tower is None:
        return
    frozen = not any(p.requires_grad for p in tower.parameters())
    version = tower_version(tower) if frozen else None
    cache = None
    if embeds.cache_dir and frozen:
        cache = EmbedCache(embeds.cache_dir, embeds.max_gb)
    elif embeds.cache_dir:
        logger.info(
            "data.cache_dir: the vision tower is trained, so its outputs change every step: the cache is bypassed "
            "(set worker.actor.model.freeze_vision_tower=true to use it)"
        )
    settings = dict(embeds.settings) | tower_settings(model) | {"compute_dtype": compute_dtype}
    install_embed_reuse(model, version, cache, settings)


class TrainableModel:
    """The sharded model of one role, with its optimizer and LR schedule when the role trains it."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        dtype = DTYPES[spec.torch_dtype] if spec.torch_dtype else torch.float32
        attn = packed_attn_implementation() if spec.forward.padding_free else None
        sp = None
        if spec.forward.sp_size > 1:  # the packed attention, wrapped in the sequence-parallel all-to-alls (and ring)
            sp = enable_sequence_parallel(spec.forward.ulysses_size, attn, spec.forward.ring_size)
            attn = sp.attn_implementation
        model = load_model(spec.model, spec.kind, dtype, attn_implementation=attn)
        if sp is not None and linear_attention_layers(model):  # the config check says so first; workers built directly
            role = "critic" if spec.kind == "value" else "actor"
            ring = spec.forward.ulysses_size == 1  # split by the ring alone: name the key that asked for it
            key, size = ("ring_size", spec.forward.ring_size) if ring else ("ulysses_size", spec.forward.ulysses_size)
            raise ConfigError(f"worker.{role}.{key}", f"{size} {SEQUENCE_PARALLEL_REFUSAL}")
        if not spec.trainable:
            model.requires_grad_(False)
        self.lora = spec.trainable and spec.model.lora.rank > 0
        """Low-rank adapters are trained (only they require gradients, and a critic's value head; see
        `easyrl.workers.lora`)."""
        if self.lora:
            from easyrl.workers.lora import apply_lora

            if spec.kind == "value":  # the critic's value head is new: it trains whole beside the adapters
                apply_lora(model, spec.model.lora, "worker.critic.model.lora", trained_whole=("score",))
            else:
                apply_lora(model, spec.model.lora)
        if spec.kind == "causal_lm":  # after freezing and adapters: whether the tower trains decides the reuse
            _reuse_tower_outputs(model, spec.embeds, tower_compute_dtype(spec, device))
        if sp is not None:  # the model carries its group: the forward head and the attention read it from there
            sp.attach(model)
        # `easyrl train` resolves auto (`easyrl.update_levers`); a null nobody resolved keeps today's default: on
        checkpointing = spec.trainable and spec.model.enable_gradient_checkpointing is not False
        compile_key = f"worker.{'critic' if spec.kind == 'value' else 'actor'}.model.compile_layers"
        compile_on = spec.model.compile_layers
        self.module: nn.Module = shard_model(
            model, spec.fsdp, device, checkpointing, compile_key if compile_on else None
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self._vision_seen = (0, 0)
        """`EmbedReuse` counters at the last `vision_counts`."""
        if spec.optim is not None:
            self.optimizer = build_optimizer(self.module, spec.optim)
            self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.total_optimizer_steps)
        else:
            self.module.eval()

    def offload(self, with_optimizer: bool = True) -> None:
        """Move what `offload` names (parameters, optimizer states) to the host (CUDA only)."""
        off = self.spec.offload
        optimizer = self.optimizer if with_optimizer else None
        offload_to_cpu(self.module, optimizer, off.offload_params, off.offload_optimizer)

    def reload(self, with_optimizer: bool = True) -> None:
        """Undo `offload`."""
        off = self.spec.offload
        optimizer = self.optimizer if with_optimizer else None
        load_to_device(self.module, optimizer, off.offload_params, off.offload_optimizer, self.device)

    @contextmanager
    def resident(self, with_optimizer: bool = True) -> Iterator[None]:
        """On the accelerator for the block only: an offloaded role holds no GPU memory while the engine generates.
        `with_optimizer=False` for forward passes (the optimizer states stay where they are)."""
        self.reload(with_optimizer)
        try:
            yield
        finally:
            self.offload(with_optimizer)

    def full_weights(self, aliases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in order, a bucket at a time; every rank must consume it (the gathers are collectives).
        With LoRA: the merged policy (base + scale * B @ A per adapted layer, one parameter at a time), under the base
        model's names. A tied parameter is gathered once; with `aliases` it is also yielded under its other names
        (`iter_full_weights`)."""
        if self.lora:
            from easyrl.workers.lora import merged_weights

            return merged_weights(self.module, aliases)
        return iter_full_weights(self.module, aliases)

    def state_sizes(self) -> dict[str, float]:
        """Trainable parameters (whole model) and this rank's optimizer-state bytes: what LoRA shrinks."""
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        state_bytes = 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        local: Any = value.to_local() if hasattr(value, "to_local") else value
                        state_bytes += local.numel() * local.element_size()
        return {"perf/trainable_params": float(trainable), "perf/optimizer_state_gb": state_bytes / 2**30}

    def vision_counts(self) -> dict[str, float]:
        """Media items this rank's vision tower encoded and items it served without encoding (duplicates, memo, disk
        cache) since the last call; {} for a text model."""
        reuse = embed_reuse_of(self.module)
        if reuse is None:
            return {}
        last = self._vision_seen
        self._vision_seen = (reuse.encoded, reuse.reused)
        return {
            "perf/vision_items_encoded": float(reuse.encoded - last[0]),
            "perf/vision_items_reused": float(reuse.reused - last[1]),
        }

    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The adapters as a PEFT adapter (tensors, adapter_config), for an engine that serves LoRA itself; every
        rank must call it (the gathers are collectives)."""
        from easyrl.workers.lora import gathered_adapter

        return gathered_adapter(self.module, self.spec.model)

    @contextmanager
    def as_reference(self) -> Iterator[None]:
        """The frozen base policy for the block: the adapters are off (LoRA only: the base is the reference)."""
        assert self.lora, "only a LoRA policy carries its reference (the base under the adapters)"
        from easyrl.workers.lora import adapters_disabled

        with adapters_disabled(self.module):
            yield


class TrainedRole(CheckpointMixin):
    """A role that trains its model (actor, critic): checkpoints its model, optimizer and LR schedule."""

    trainable: TrainableModel

    def build_trainable(self, spec: ModelSpec, device: torch.device) -> TrainableModel:
        """Build the role's `TrainableModel` and expose what `CheckpointMixin` saves (model, optimizer, scheduler)."""
        trainable = TrainableModel(spec, device)
        assert trainable.optimizer is not None, "a trained role needs worker.<role>.optim"
        self.trainable = trainable
        self.model, self.optimizer, self.scheduler = trainable.module, trainable.optimizer, trainable.scheduler
        return trainable

    def checkpoint_sources(self) -> tuple[str | None, str | None]:
        return self.trainable.spec.checkpoint_files

    def adapter_checkpoint(self) -> dict[str, Any] | None:
        if not self.trainable.lora:
            return None
        from easyrl.workers.lora import adapter_description

        return adapter_description(self.trainable.module, self.trainable.spec.model)
