"""Forward passes over whole batches and the mini-batch/micro-batch update loop shared by the actor, reference and
critic roles. The per-micro-batch forward head (`token_log_probs`, `response_values`) is `easyrl.workers.head`."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from easyrl.algorithms import agg_count
from easyrl.algorithms.logprob_gap import exact_metrics
from easyrl.batch import Batch
from easyrl.workers.batching import MicroBatches, make_micro_batches
from easyrl.workers.head import response_values, token_log_probs
from easyrl.workers.specs import ForwardOptions, UpdateSpec
from easyrl.workers.trainable import TrainableModel


__all__ = [
    "FirstForwardOld",
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
    # forward-only: no graph kept, so its own (larger) token budget (`ForwardOptions.log_prob_max_token_len`)
    mbs = make_micro_batches(batch, micro_batch_size, opts.forward_only_token_len if opts else None)
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
    ratios: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Metrics exact over the whole mini-batch whatever its rows weigh (`rollout/token_prob_error`: only some rows
    have engine log-probs), as this micro-batch's (numerator, denominator) sums: each summed over the micro-batches
    and ranks, the metric left out when the denominator is 0. Kept for the first mini-batch of an update only (the
    weights before any optimizer step)."""
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metrics that are maxima over the whole mini-batch (`rollout/logprob_diff_max`): this micro-batch's, -inf over
    nothing (then left out)."""
    own_old_log_prob: torch.Tensor | None = None
    """(b, R) detached: the current log-probs this forward took as the old ones (the micro-batch brought none);
    `optimize` keeps mini-batch 1's as its rows' old log-probs when told to (`FirstForwardOld`)."""


@dataclass(frozen=True)
class FirstForwardOld:
    """Mini-batch 1's old log-probs from the update's own first forward (`worker.actor.reuse_first_forward`): the
    rest of the rank's rows came through a forward-only pass with the same, unmoved weights before `optimize`."""

    rest: torch.Tensor
    """(B - m, R): the old log-probs of this rank's rows after its first mini-batch of m rows, in the batch's order."""
    ratios: dict[str, torch.Tensor] = field(default_factory=dict)
    """Those rows' parts of the exact metrics (`MicroBatchLoss.ratios`), each a float64 (numerator, denominator)
    pair stacked in one (2,) tensor: added to mini-batch 1's, so the figures cover every row as a whole pass does."""
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    """Those rows' parts of the exact maxima (`MicroBatchLoss.maxima`)."""


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


def exact_over_ranks(
    ratios: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor], device: torch.device, sp_size: int
) -> dict[str, float]:
    """`MicroBatchLoss.ratios` and `.maxima` of every rank, summed (each a (numerator, denominator) float64 pair) or
    maxed over the ranks, then finished (`exact_metrics`): the same values on every rank, in one collective. A
    sequence-parallel group's ranks hold the same rows: their sums count once. The keys must be the same on every
    rank (they depend on which tensors a batch holds, never on their values)."""
    ratio_keys, max_keys = sorted(ratios), sorted(maxima)
    if not ratio_keys and not max_keys:
        return {}
    local = torch.cat([*(ratios[k] for k in ratio_keys), *(maxima[k].reshape(1) for k in max_keys)])
    local = local.to(device=device, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # One all-gather for both: sums and maxima need different reductions, and float64 keeps the sums exact.
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        gathered = torch.stack(parts)
    else:
        gathered = local.unsqueeze(0)
    sums = (gathered[:, : 2 * len(ratio_keys)].sum(dim=0) / sp_size).tolist()  # in rank order: alike on every rank
    tops = gathered[:, 2 * len(ratio_keys) :].amax(dim=0).tolist()
    pairs = {k: (sums[2 * i], sums[2 * i + 1]) for i, k in enumerate(ratio_keys)}
    return exact_metrics(pairs, dict(zip(max_keys, tops)))


SyncSetter = Callable[[bool], None]
"""Turns the model's gradient reduction on or off for the next backward (FSDP2's `set_requires_gradient_sync`)."""


def gradient_sync_setter(model: nn.Module) -> SyncSetter | None:
    """`model.set_requires_gradient_sync` for a multi-rank FSDP2 model, else None: one rank has nothing to reduce."""
    from torch.distributed.fsdp import FSDPModule

    multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not (multi_rank and isinstance(model, FSDPModule)):
        return None
    return model.set_requires_gradient_sync


@contextlib.contextmanager
def _deferred_sync(model: nn.Module, on: bool) -> Iterator[SyncSetter | None]:
    """The model's gradient-sync setter while `on` (None otherwise), reduction turned back on at exit: an exception
    between micro-batches must not leave it off."""
    set_sync = gradient_sync_setter(model) if on else None
    try:
        yield set_sync
    finally:
        if set_sync is not None:
            set_sync(True)


def _backward_mini_batch(
    mbs: MicroBatches,
    loss_fn: LossFn,
    device: torch.device,
    loss_agg_mode: str,
    sp_size: int,
    exact: bool = True,
    set_sync: SyncSetter | None = None,
    exact_before: FirstForwardOld | None = None,
) -> tuple[float, dict[str, float]]:
    """Forward and backward over one mini-batch's micro-batches; returns (the mini-batch's loss, its metrics), each
    the value over the whole mini-batch on all ranks, identical on every rank.

    Each micro-batch's loss is the objective aggregated over that micro-batch; weighing it by
    `agg_count(micro-batch) / agg_count(mini-batch on all ranks)` makes the sum over the micro-batches of every rank
    the whole mini-batch's objective, whatever the layout (ranks, sequence-parallel groups, micro-batch sizes,
    token-budget micro-batches). FSDP2 averages gradients over all `dp * sp` ranks and the sequence-parallel gather's
    backward multiplies by `sp` (`easyrl.distributed.sequence_parallel`), so the loss backpropagated is also
    multiplied by `dp`: the averaged gradient is then the gradient of the global objective.

    With `set_sync`, only the last micro-batch's backward reduces: the others accumulate unsharded gradients (every
    rank runs the same number of micro-batches, dummies included, so all ranks reduce on the same one).
    `exact_before`: exact-metric parts of rows outside this mini-batch, added before the reduction.
    """
    # Weighed by the tokens the loss counts (`loss_mask`), not those attended: tool output carries no weight.
    masks = [mb["loss_mask"] for mb, dummy in zip(mbs.parts, mbs.dummy) if not dummy]
    local = [sum(float(m.double().sum()) for m in masks), sum(agg_count(m, loss_agg_mode) for m in masks)]
    # One collective per mini-batch: the global valid tokens and the global count the aggregation divides by.
    tokens, count = sum_over_ranks(torch.tensor(local, dtype=torch.float64, device=device), sp_size).tolist()
    dp = data_parallel_size(sp_size)
    sums: dict[str, torch.Tensor | float] = {}
    # (numerator, denominator) float64, summed over the micro-batches (and the rows of `exact_before`)
    ratios: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}
    if exact_before is not None:
        ratios = {k: v.to(device=device, dtype=torch.float64) for k, v in exact_before.ratios.items()}
        maxima = {k: v.to(device=device, dtype=torch.float64) for k, v in exact_before.maxima.items()}
    last = len(mbs.parts) - 1
    for i, (mb, dummy) in enumerate(zip(mbs.parts, mbs.dummy)):
        if set_sync is not None:
            set_sync(i == last)
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
        _accumulate_exact(out, dummy, ratios, maxima)
    # Summed on the device and read once per mini-batch: a float() per micro-batch would stall the device each time.
    keys = sorted(sums)  # the same keys on every rank (dummies name them too), in the same order
    stacked = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=device) for k in keys])
    values = dict(zip(keys, sum_over_ranks(stacked, sp_size).tolist()))
    if exact:  # every rank takes the same branch: the same mini-batch index
        values |= exact_over_ranks(ratios, maxima, device, sp_size)
    return values.pop(""), values


def _accumulate_exact(
    out: MicroBatchLoss, dummy: bool, ratios: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor]
) -> None:
    """Add one micro-batch's `ratios` and `maxima` into the mini-batch's. A dummy adds nothing (zeros, -inf) but
    names its keys, so that every rank reduces the same ones."""
    for key, (num, den) in out.ratios.items():
        pair = torch.stack([num.detach(), den.detach()]).to(torch.float64)
        pair = torch.zeros_like(pair) if dummy else pair  # zeros, not pair * 0: a dummy's NaN would survive that
        ratios[key] = ratios[key] + pair if key in ratios else pair
    for key, value in out.maxima.items():
        top = value.detach().to(torch.float64)
        top = torch.full_like(top, float("-inf")) if dummy else top
        maxima[key] = torch.maximum(maxima[key], top) if key in maxima else top


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
    defer_gradient_sync: bool = False,
    first_forward_old: FirstForwardOld | None = None,
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch optimizer steps with gradient accumulation over micro-batches.

    Each optimizer step follows the gradient of the objective over the whole mini-batch, the rows of all ranks
    together (`_backward_mini_batch`), so neither the number of ranks, the sequence-parallel size, nor the
    micro-batches (fixed-count, or token-budget ones with `max_token_len`) change it, up to float reduction order.
    `mini_batch_size` is this rank's share (`sp_size` ranks share one, holding the same rows). Metrics are the
    global values, averaged over the mini-batches. A non-finite loss or gradient norm skips that optimizer step
    (gradients dropped, counted in `<prefix>/skipped_updates`); the caller decides when to stop.
    `defer_gradient_sync`: a multi-rank FSDP2 model reduces its gradients on each mini-batch's last micro-batch only.
    `first_forward_old`: `batch` has no `old_log_probs`; the rows after the first mini-batch take `rest`, the first
    mini-batch its own first forward's (`MicroBatchLoss.own_old_log_prob`), which later epochs read.
    """
    minis = batch.split(mini_batch_size)
    if first_forward_old is not None:
        rest = first_forward_old.rest.split(mini_batch_size) if len(minis) > 1 else ()  # (0, R) splits into 1 part
        for mini, old in zip(minis[1:], rest, strict=True):
            mini.set(old_log_probs=old)
    with _deferred_sync(model, defer_gradient_sync) as set_sync:
        metrics: dict[str, list[float]] = defaultdict(list)
        skipped = nonfinite_loss = nonfinite_grad = 0
        for epoch in range(epochs):
            for index, mini in enumerate(minis):
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over this mini-batch's micro-batches only
                mbs = make_micro_batches(mini, micro_batch_size, max_token_len)
                # `MicroBatchLoss.ratios`/`.maxima` of the first mini-batch only: the later ones run moved weights
                first = epoch == 0 and index == 0
                fills = first and first_forward_old is not None
                owns: list[torch.Tensor | None] = []
                loss, mini_metrics = _backward_mini_batch(
                    mbs, _keeping_own_old(loss_fn, owns) if fills else loss_fn, device, loss_agg_mode, sp_size,
                    exact=first, set_sync=set_sync, exact_before=first_forward_old if fills else None,
                )  # fmt: skip
                # This forward ran the weights the pass would have: its log-probs are the rows' old ones from now on.
                if fills:
                    mini.set(old_log_probs=_own_old(mbs, owns))
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


def _keeping_own_old(loss_fn: LossFn, owns: list[torch.Tensor | None]) -> LossFn:
    """`loss_fn`, keeping each micro-batch's `MicroBatchLoss.own_old_log_prob` in `owns` (dummies too, in run
    order); only that detached tensor, not the loss and its graph."""

    def keeping(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        out = loss_fn(mb, on_device)
        owns.append(out.own_old_log_prob)
        return out

    return keeping


def _own_old(mbs: MicroBatches, owns: list[torch.Tensor | None]) -> torch.Tensor:
    """The mini-batch's own old log-probs (rows, R) on the host, in the mini-batch's order (dummies dropped)."""
    parts = []
    for own, dummy in zip(owns, mbs.dummy, strict=True):
        if dummy:
            continue
        if own is None:
            raise ValueError("the loss gave no own_old_log_prob: it cannot fill mini-batch 1's old log-probs")
        parts.append(own.cpu())
    return mbs.restore(torch.cat(parts))


def update_model(
    trainable: TrainableModel,
    batch: Batch,
    spec: UpdateSpec,
    loss_fn: LossFn,
    prefix: str,
    first_forward_old: FirstForwardOld | None = None,
) -> dict[str, float]:
    """`optimize` a role's model over `batch` with the sizes of its `UpdateSpec` (already per rank) and, for the
    actor, `first_forward_old`."""
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
        sp_size=trainable.spec.forward.sp_size,
        defer_gradient_sync=spec.defer_gradient_sync,
        first_forward_old=first_forward_old,
    )
