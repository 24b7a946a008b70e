"""The update-side speed levers of issue 44 that the memory plan decides, as pure functions of the config, the model's
shape and the GPU's size: decided once on the driver before the trainer starts (`resolve_update_levers`, called by
`easyrl train` and `easyrl sft`), printed with their reasons by `easyrl check`.

- **Gradient checkpointing** (`worker.actor.model.enable_gradient_checkpointing`, null = auto): recompute costs a
  forward per layer in the backward (~1/3 of the update's FLOPs). Off when the update without it fits within
  `HEADROOM` of the GPU beside the sleeping engine (the plan's `updating` moment), on otherwise. On CPU there is no
  device to plan against and recompute only costs time, so auto is off; a diffusion denoiser keeps it on (its plan is
  `easyrl.diffusion_memory`'s). Checkpointing changes no value: the recomputed forward is the same arithmetic.
- **Deferred gradient sync** (`worker.actor.defer_gradient_sync`, null = auto): one reduce-scatter per mini-batch
  instead of one per micro-batch, paid for with each rank's unsharded gradients (`TrainingMemory.accumulated_grads`).
  Auto: on for a multi-rank GPU run whose plan fits with them; off on one rank (nothing to reduce) and on CPU (gloo
  runs keep today's summation order, so their figures stay).
- **The forward-only budget** (`worker.actor.log_prob_max_token_len_per_gpu`, null = auto): old and reference
  log-prob passes keep no graph, so a micro-batch of them can hold more tokens than the update's in the same memory:
  the largest budget whose forward-only activations fit in the update's activation bytes, at most `MAX_LOG_PROB_FACTOR`
  times the update's budget. On CPU the update's budget (the padded CPU path gains nothing from bigger batches).

Where the GPU is not visible to the driver (a GPU run planned from a login node), auto takes the safe side:
checkpointing on, sync per micro-batch, the update's budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from easyrl.config import EasyRLConfig
    from easyrl.memory_plan import ModelShape
    from easyrl.trainer.plan import RunPlan


__all__ = [
    "HEADROOM",
    "MAX_LOG_PROB_FACTOR",
    "UpdateLevers",
    "choose_levers",
    "resolve_levers",
    "resolve_update_levers",
    "resolved_config",
]

HEADROOM = 0.9
"""Share of the GPU a lever may plan to use: the plan's estimates are meant to hold within 10% (issue 44 item 5), so
a setting that fits only in the last 10% is not taken."""
MAX_LOG_PROB_FACTOR = 8
"""The forward-only budget is at most this many times the update's: beyond it the passes are few already and a
micro-batch's padding-free row only grows the per-row work of the attention kernels."""


@dataclass(frozen=True)
class UpdateLevers:
    """The levers' values for one run, each with why (the figures compared, or the key that set it)."""

    gradient_checkpointing: bool
    gradient_checkpointing_why: str
    defer_gradient_sync: bool
    defer_gradient_sync_why: str
    log_prob_max_token_len: int | None
    """Per-rank token budget of the forward-only passes; None: fixed-count micro-batches (no dynamic batching)."""
    log_prob_max_token_len_why: str

    def lines(self) -> list[str]:
        """What `easyrl check` prints."""
        on = {True: "on", False: "off"}
        budget = "fixed-count micro-batches" if self.log_prob_max_token_len is None else self.log_prob_max_token_len
        return [
            f"gradient checkpointing: {on[self.gradient_checkpointing]} ({self.gradient_checkpointing_why})",
            f"deferred gradient sync: {on[self.defer_gradient_sync]} ({self.defer_gradient_sync_why})",
            f"log-prob passes' token budget per worker: {budget} ({self.log_prob_max_token_len_why})",
        ]


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def choose_levers(
    cfg: EasyRLConfig, use_gpu: bool, world_size: int, shape: ModelShape | None, device_total: int | None
) -> UpdateLevers:
    """The levers of the text run `cfg` (`use_gpu`, `world_size`: the run plan's), with `shape` and `device_total`
    the model's and the GPU's when the driver can see them (else None: the safe side)."""
    actor = cfg.worker.actor
    planned = use_gpu and shape is not None and device_total is not None
    ckpt, ckpt_why = _checkpointing(cfg, use_gpu, shape if planned else None, device_total)
    trial = copy.deepcopy(cfg)
    _set_checkpointing(trial, ckpt)
    sync, sync_why = _deferred_sync(trial, use_gpu, world_size, shape if planned else None, device_total)
    trial.worker.actor.defer_gradient_sync = sync
    if not actor.dynamic_batching:
        return UpdateLevers(ckpt, ckpt_why, sync, sync_why, None, "worker.actor.dynamic_batching is off")
    budget, budget_why = _log_prob_budget(trial, shape if planned else None)
    return UpdateLevers(ckpt, ckpt_why, sync, sync_why, budget, budget_why)


def _checkpointing(
    cfg: EasyRLConfig, use_gpu: bool, shape: ModelShape | None, device_total: int | None
) -> tuple[bool, str]:
    explicit = cfg.worker.actor.model.enable_gradient_checkpointing
    if explicit is not None:
        return explicit, f"worker.actor.model.enable_gradient_checkpointing: {str(explicit).lower()}, as set"
    if not use_gpu:
        return False, "auto on CPU: no device memory to plan against, and recompute only costs time"
    if shape is None or device_total is None:
        return True, "auto: no GPU visible here to plan against, so the side that saves memory"
    from easyrl.memory_plan import plan_memory

    trial = copy.deepcopy(cfg)
    _set_checkpointing(trial, False)
    without = plan_memory(shape, trial, device_total)
    room = int(HEADROOM * device_total)
    figures = (
        f"the update without it needs {_gib(without.updating)} (activations {_gib(without.actor.activations)}, "
        f"the sleeping engine's CUDA graphs {_gib(without.cuda_graphs)}) of {_gib(room)} "
        f"({HEADROOM:.0%} of {_gib(device_total)})"
    )
    if without.updating <= room:
        return False, f"auto: {figures}"
    return True, f"auto: {figures}; recompute instead"


def _deferred_sync(
    cfg: EasyRLConfig, use_gpu: bool, world_size: int, shape: ModelShape | None, device_total: int | None
) -> tuple[bool, str]:
    explicit = cfg.worker.actor.defer_gradient_sync
    if explicit is not None:
        return explicit, f"worker.actor.defer_gradient_sync: {str(explicit).lower()}, as set"
    if world_size == 1:
        return False, "auto: one rank, no gradient reduction to defer"
    if not use_gpu:
        return False, "auto on CPU: gloo runs keep one reduction per micro-batch (today's summation order)"
    if shape is None or device_total is None:
        return False, "auto: no GPU visible here to plan the unsharded gradients against"
    from easyrl.memory_plan import plan_memory

    trial = copy.deepcopy(cfg)
    trial.worker.actor.defer_gradient_sync = True
    with_it = plan_memory(shape, trial, device_total)
    room = int(HEADROOM * device_total)
    figures = (
        f"the update with the unsharded gradients ({_gib(with_it.actor.accumulated_grads)}) needs "
        f"{_gib(with_it.updating)} of {_gib(room)}"
    )
    if with_it.updating <= room:
        return True, f"auto: {figures}"
    return False, f"auto: {figures}; one reduction per micro-batch instead"


def _log_prob_budget(cfg: EasyRLConfig, shape: ModelShape | None) -> tuple[int, str]:
    actor = cfg.worker.actor
    update = int(actor.max_token_len_per_gpu)
    if actor.log_prob_max_token_len_per_gpu is not None:
        return int(actor.log_prob_max_token_len_per_gpu), "worker.actor.log_prob_max_token_len_per_gpu, as set"
    if shape is None:
        return update, "auto without a GPU plan: the update's worker.actor.max_token_len_per_gpu"
    from easyrl.memory_plan import DTYPE_BYTES, forward_only_activations, head_activations, layer_activations

    act = DTYPE_BYTES[actor.fsdp.mp_param_dtype]
    checkpointing = actor.model.enable_gradient_checkpointing is not False
    # the update's micro-batch memory (layers kept for the backward, head): what a forward-only one may use instead
    allowed = layer_activations(shape, update, act, checkpointing) + head_activations(shape, actor, update)
    per_token = forward_only_activations(shape, 1, act)
    # a forward-only pass builds no weight gradient: its head is one chunk (fused) or per-token logits
    head_per_token = head_activations(shape, actor, update + 1, False) - head_activations(shape, actor, update, False)
    fixed_head = head_activations(shape, actor, update, False) - update * head_per_token  # the fused head's one chunk
    fits = max(update, (allowed - fixed_head) // (per_token + head_per_token))
    budget = min(fits, MAX_LOG_PROB_FACTOR * update)
    capped = f", capped at {MAX_LOG_PROB_FACTOR}x" if fits > budget else ""
    return budget, (
        f"auto: a forward-only micro-batch of {budget} tokens fits in the update's {_gib(allowed)} of activations "
        f"({update} tokens{', checkpointed' if checkpointing else ''}){capped}"
    )


def _set_checkpointing(cfg: EasyRLConfig, on: bool) -> None:
    """Set the actor's (and a critic's auto) checkpointing: the critic's own true/false stays as set."""
    cfg.worker.actor.model.enable_gradient_checkpointing = on
    if cfg.worker.critic.model.enable_gradient_checkpointing is None:
        cfg.worker.critic.model.enable_gradient_checkpointing = on


def resolve_levers(cfg: EasyRLConfig, plan: RunPlan) -> UpdateLevers:
    """The levers of the run `cfg` on this machine: the GPU the driver sees (device 0) and the model's HF config when
    the run trains on GPUs here, else the rules without a plan. A diffusion run keeps checkpointing on when auto."""
    if plan.modality == "diffusion":
        explicit = cfg.worker.actor.model.enable_gradient_checkpointing
        ckpt = True if explicit is None else explicit
        why = "auto: a diffusion denoiser (easyrl/diffusion_memory.py plans it)" if explicit is None else "as set"
        return UpdateLevers(ckpt, why, False, "diffusion: not wired", None, "diffusion: no log-prob passes")
    shape, total = None, None
    if plan.use_gpu:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            shape = model_shape(cfg)
    return choose_levers(cfg, plan.use_gpu, plan.world_size, shape, total)


def resolve_update_levers(cfg: EasyRLConfig, task: str = "rl") -> EasyRLConfig:
    """`cfg` with its auto levers decided on this machine (`resolve_levers`), each choice and its reason logged: what
    `easyrl train` and `easyrl sft` start from. Up here, not in the trainer: the levers read the memory plan, which
    reads the trainer's run plan. A config nobody resolved keeps today's defaults (checkpointing on, one reduction per
    micro-batch, the update's budget)."""
    import logging

    from easyrl.trainer.plan import plan_of

    levers = resolve_levers(cfg, plan_of(cfg, task))
    for line in levers.lines():
        logging.getLogger("easyrl").info("update lever: %s", line)
    resolved: EasyRLConfig = resolved_config(cfg, levers)
    return resolved


def model_shape(cfg: EasyRLConfig) -> ModelShape:
    """The actor model's shape from its HF config (no weights loaded)."""
    from transformers import AutoConfig

    from easyrl.memory_plan import ModelShape

    mcfg = cfg.worker.actor.model
    assert mcfg.model_path is not None
    return ModelShape.from_hf_config(
        AutoConfig.from_pretrained(mcfg.model_path, trust_remote_code=mcfg.trust_remote_code)
    )


def resolved_config(cfg: Any, levers: UpdateLevers) -> Any:
    """A copy of `cfg` with every auto lever replaced by its value (what the role specs and the memory plan read)."""
    out = copy.deepcopy(cfg)
    _set_checkpointing(out, levers.gradient_checkpointing)
    out.worker.actor.defer_gradient_sync = levers.defer_gradient_sync
    out.worker.actor.log_prob_max_token_len_per_gpu = levers.log_prob_max_token_len
    return out
