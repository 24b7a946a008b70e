"""Forward passes over whole batches and the mini-batch/micro-batch update loop shared by the actor, reference and
critic roles. The per-micro-batch forward head (`token_log_probs`, `response_values`) is `easyrl.workers.head`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from easyrl.algorithms import agg_count
from easyrl.batch import Batch
from easyrl.workers.batching import MicroBatches, make_micro_batches
from easyrl.workers.head import response_values, token_log_probs
from easyrl.workers.specs import ForwardOptions, UpdateSpec
from easyrl.workers.trainable import TrainableModel


__all__ = [
    "MicroBatchLoss",
    "batched_log_probs",
    "batched_values",
    "optimize",
    "response_values",
    "token_log_probs",
    "update_model",
]


@torch.no_grad()
def batched_log_probs(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float,
    micro_batch_size: int,
    with_entropy: bool = False,
    opts: ForwardOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_log_probs` over a whole batch in micro-batches (token-budget ones with dynamic batching): (B, R)
    each, on CPU, in the batch's order."""
    mbs = make_micro_batches(batch, micro_batch_size, opts.max_token_len if opts else None)
    lps, ents = [], []
    for mb, dummy in zip(mbs.parts, mbs.dummy):
        lp, ent = token_log_probs(model, mb, device, temperature, with_entropy, opts)
        if dummy:  # run only so every rank joins the same number of FSDP collectives
            continue
        lps.append(lp.cpu())
        if ent is not None:
            ents.append(ent.cpu())
    # The real parts in run order, put back in the batch's order (token-budget micro-batches permute the rows).
    return mbs.restore(torch.cat(lps)), (mbs.restore(torch.cat(ents)) if with_entropy else None)


@torch.no_grad()
def batched_values(
    model: nn.Module, batch: Batch, device: torch.device, micro_batch_size: int, opts: ForwardOptions | None = None
) -> torch.Tensor:
    """`response_values` over a whole batch in micro-batches: (B, R) on CPU, in the batch's order."""
    mbs = make_micro_batches(batch, micro_batch_size, opts.max_token_len if opts else None)
    # Dummies run too (every rank must join the same FSDP collectives); their values are dropped below.
    parts = [response_values(model, mb, device, opts).cpu() for mb in mbs.parts]
    return mbs.restore(torch.cat([v for v, dummy in zip(parts, mbs.dummy) if not dummy]))


@dataclass
class MicroBatchLoss:
    """One micro-batch's loss and metrics, each aggregated over that micro-batch alone: `optimize` weighs them."""

    loss: torch.Tensor
    """Scalar to backpropagate (with grad): the objective aggregated over this micro-batch with `loss_agg_mode`."""
    terms: dict[str, torch.Tensor]
    """Metrics aggregated like the loss (`actor/pg_loss`, `actor/entropy`, `critic/vf_loss`): weighed like it."""
    token_means: dict[str, torch.Tensor | float]
    """Metrics that are means over the micro-batch's valid tokens (clip fractions, `actor/ppo_kl`): token-weighted."""


LossFn = Callable[[Batch, Batch], MicroBatchLoss]
"""(micro-batch on the host, for the forward pass; the same micro-batch on the loss's device, the one source of every
tensor the loss uses) -> its `MicroBatchLoss`."""


def data_parallel_size(sp_size: int) -> int:
    """Data-parallel groups: all ranks over the ranks of one sequence-parallel group (which hold the same rows)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return world // sp_size


def sum_over_ranks(values: torch.Tensor, sp_size: int) -> torch.Tensor:
    """Sum of `values` over the data-parallel groups, on every rank: an all-reduce over all ranks, divided by the
    `sp_size` ranks of a sequence-parallel group that each hold the same rows (so every row counts once)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values / sp_size


def _backward_mini_batch(
    mbs: MicroBatches, loss_fn: LossFn, device: torch.device, loss_agg_mode: str, sp_size: int
) -> tuple[float, dict[str, float]]:
    """Forward and backward over one mini-batch's micro-batches; returns (the mini-batch's loss, its metrics), each
    the value over the whole mini-batch on all ranks, identical on every rank.

    Each micro-batch's loss is the objective aggregated over that micro-batch; weighing it by
    `agg_count(micro-batch) / agg_count(mini-batch on all ranks)` makes the sum over the micro-batches of every rank
    the whole mini-batch's objective, whatever the layout (ranks, sequence-parallel groups, micro-batch sizes,
    token-budget micro-batches). FSDP2 averages gradients over all `dp * sp` ranks and the sequence-parallel gather's
    backward multiplies by `sp` (`easyrl.distributed.sequence_parallel`), so the loss backpropagated is also
    multiplied by `dp`: the averaged gradient is then the gradient of the global objective.
    """
    # Weighed by the tokens the loss counts (`loss_mask`), not those attended: tool output carries no weight.
    masks = [mb["loss_mask"] for mb, dummy in zip(mbs.parts, mbs.dummy) if not dummy]
    local = [sum(float(m.double().sum()) for m in masks), sum(agg_count(m, loss_agg_mode) for m in masks)]
    # One collective per mini-batch: the global valid tokens and the global count the aggregation divides by.
    tokens, count = sum_over_ranks(torch.tensor(local, dtype=torch.float64, device=device), sp_size).tolist()
    dp = data_parallel_size(sp_size)
    sums: dict[str, torch.Tensor | float] = {}
    for mb, dummy in zip(mbs.parts, mbs.dummy):
        out = loss_fn(mb, mb.to(device))  # the micro-batch's one transfer to the device
        mask = mb["loss_mask"]
        # Host-side shares (the mask is on the host): no device sync. A dummy (run only so every rank joins the same
        # FSDP collectives) weighs 0 and reports nothing, but names the metrics so every rank reduces the same keys.
        share = 0.0 if dummy or count == 0 else agg_count(mask, loss_agg_mode) / count
        token_share = 0.0 if dummy or tokens == 0 else float(mask.double().sum()) / tokens
        # x dp: FSDP2 divides the summed gradient by dp * sp, and the sequence-parallel gather multiplies it by sp.
        (out.loss * (share * dp)).backward()
        weighted: dict[str, tuple[torch.Tensor | float, float]] = {"": (out.loss, share)}
        weighted |= {k: (v, share) for k, v in out.terms.items()}
        weighted |= {k: (v, token_share) for k, v in out.token_means.items()}
        for key, (value, weight) in weighted.items():
            part = 0.0 if dummy else (value.detach() if isinstance(value, torch.Tensor) else value) * weight
            sums[key] = sums.get(key, 0.0) + part
    # Summed on the device and read once per mini-batch: a float() per micro-batch would stall the device each time.
    keys = sorted(sums)  # the same keys on every rank (dummies name them too), in the same order
    stacked = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=device) for k in keys])
    values = dict(zip(keys, sum_over_ranks(stacked, sp_size).tolist()))
    return values.pop(""), values


def optimize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: Batch,
    *,
    device: torch.device,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    max_grad_norm: float,
    loss_fn: LossFn,
    prefix: str,
    loss_agg_mode: str = "token-mean",
    max_token_len: int | None = None,
    sp_size: int = 1,
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch optimizer steps with gradient accumulation over micro-batches.

    Each optimizer step follows the gradient of the objective over the whole mini-batch, the rows of all ranks
    together (`_backward_mini_batch`), so neither the number of ranks, the sequence-parallel size, nor the
    micro-batches (fixed-count, or token-budget ones with `max_token_len`) change it, up to float reduction order.
    `mini_batch_size` is this rank's share (`sp_size` ranks share one, holding the same rows). Metrics are the
    global values, averaged over the mini-batches. A non-finite loss or gradient norm skips that optimizer step
    (gradients dropped, counted in `<prefix>/skipped_updates`); the caller decides when to stop.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    skipped = nonfinite_loss = nonfinite_grad = 0
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)  # gradients accumulate over this mini-batch's micro-batches only
            mbs = make_micro_batches(mini, micro_batch_size, max_token_len)
            loss, mini_metrics = _backward_mini_batch(mbs, loss_fn, device, loss_agg_mode, sp_size)
            for k, v in mini_metrics.items():
                metrics[k].append(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            grad_norm_value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            # Both are global (an all-reduce, the norm of the whole sharded gradient), so every rank decides alike;
            # inf and NaN survive any summation order.
            loss_ok, grad_ok = math.isfinite(loss), math.isfinite(grad_norm_value)
            if loss_ok and grad_ok:
                optimizer.step()
                metrics[f"{prefix}/grad_norm"].append(grad_norm_value)
            else:  # the gradients are dropped: nothing non-finite reaches the optimizer
                skipped += 1
                nonfinite_loss += int(not loss_ok)
                nonfinite_grad += int(loss_ok and not grad_ok)
                optimizer.zero_grad(set_to_none=True)
            # Advanced on a skipped update too: the schedule follows the step count it was built for.
            scheduler.step()
            metrics[f"{prefix}/lr"].append(float(scheduler.get_last_lr()[0]))
    out = {k: sum(v) / len(v) for k, v in metrics.items()}
    out[f"{prefix}/skipped_updates"] = float(skipped)
    out[f"{prefix}/nonfinite_loss"] = float(nonfinite_loss)
    out[f"{prefix}/nonfinite_grad_norm"] = float(nonfinite_grad)
    return out


def update_model(
    trainable: TrainableModel, batch: Batch, spec: UpdateSpec, loss_fn: LossFn, prefix: str
) -> dict[str, float]:
    """`optimize` a role's model over `batch` with the sizes of its `UpdateSpec` (already per rank)."""
    assert trainable.optimizer is not None, "a frozen model has no optimizer to update"
    return optimize(
        trainable.module,
        trainable.optimizer,
        trainable.scheduler,
        batch,
        device=trainable.device,
        mini_batch_size=spec.mini_batch_size,
        micro_batch_size=spec.micro_batch_size,
        epochs=spec.epochs,
        max_grad_norm=spec.max_grad_norm,
        loss_fn=loss_fn,
        prefix=prefix,
        loss_agg_mode=spec.loss_avg_mode,
        max_token_len=trainable.spec.forward.max_token_len,
        sp_size=trainable.spec.forward.ulysses_size,
    )
