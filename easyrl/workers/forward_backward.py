"""Forward passes and the mini-batch/micro-batch update loop shared by the actor, reference and critic roles."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from easyrl.algorithms import entropy_from_logits, logprobs_from_logits
from easyrl.batch import Batch
from easyrl.models import multimodal_forward_kwargs
from easyrl.workers.batching import make_micro_batches
from easyrl.workers.model_setup import all_finite
from easyrl.workers.packing import fused_forward, prepare_inputs
from easyrl.workers.specs import ForwardOptions, UpdateSpec
from easyrl.workers.trainable import TrainableModel
from easyrl.workers.ulysses import sp_response_values, sp_token_log_probs


def response_logits(model: nn.Module, mb: Batch, device: torch.device) -> torch.Tensor:
    """Logits predicting each response token: (b, R, V) from a forward pass over prompt+response (b, P+R)."""
    response_len = mb["responses"].shape[1]
    # Vision-language rows: this micro-batch's patches and grids, and 3D (M-RoPE) positions for the 1D ones.
    media = multimodal_forward_kwargs(mb, model, device)
    position_ids = media.pop("position_ids", None)
    out = model(
        input_ids=mb["input_ids"].to(device),
        attention_mask=mb["attention_mask"].to(device),
        position_ids=position_ids if position_ids is not None else mb["position_ids"].to(device),
        use_cache=False,
        **media,
    )
    return out.logits[:, -response_len - 1 : -1]


def token_log_probs(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    opts: ForwardOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token under `model` at `temperature`: (b, R), and its entropy (b, R).

    `opts` picks the layout (padded, trimmed or packed) and the head (full logits or fused chunks); every path
    gives the same values at valid response tokens, for text and vision-language rows alike. The non-plain paths
    give 0 at padding.
    """
    if opts is not None and opts.ulysses_size > 1:
        return sp_token_log_probs(model, mb, device, temperature, with_entropy, opts)
    if opts is None or opts.plain:
        logits = response_logits(model, mb, device).float()
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        log_probs = logprobs_from_logits(logits, mb["responses"].to(device))
        entropy = entropy_from_logits(logits) if with_entropy else None
        return log_probs, entropy
    inputs = prepare_inputs(mb, opts.padding_free, model).to(device)
    if opts.fused:
        lp, ent = fused_forward(model, inputs, temperature, opts.chunk_size)
        return inputs.scatter(lp), (inputs.scatter(ent) if with_entropy else None)
    # Packed rows: `logits_to_keep` (a tensor of positions) makes the model compute logits only where needed.
    keep: dict[str, torch.Tensor] = {"logits_to_keep": inputs.select} if opts.padding_free else {}
    out = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **keep,
        **inputs.media,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    logits = (logits if opts.padding_free else logits.index_select(0, inputs.select)).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = inputs.scatter(logprobs_from_logits(logits, inputs.labels))
    return lp, (inputs.scatter(entropy_from_logits(logits)) if with_entropy else None)


def response_values(
    model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions | None = None
) -> torch.Tensor:
    """A value model's estimate of the state before each response token: (b, R), zeros at padding."""
    if opts is not None and opts.ulysses_size > 1:
        return sp_response_values(model, mb, device, opts)
    if opts is None or opts.plain:
        values = response_logits(model, mb, device)[..., 0].float()
        return values * mb["response_mask"].to(device)
    inputs = prepare_inputs(mb, opts.padding_free, model).to(device)
    out = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **inputs.media,
    )
    values = inputs.scatter(out.logits.reshape(-1).index_select(0, inputs.select).float())
    return values * mb["response_mask"].to(device)


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
    return mbs.restore(torch.cat(lps)), (mbs.restore(torch.cat(ents)) if with_entropy else None)


@torch.no_grad()
def batched_values(
    model: nn.Module, batch: Batch, device: torch.device, micro_batch_size: int, opts: ForwardOptions | None = None
) -> torch.Tensor:
    """`response_values` over a whole batch in micro-batches: (B, R) on CPU, in the batch's order."""
    mbs = make_micro_batches(batch, micro_batch_size, opts.max_token_len if opts else None)
    parts = [response_values(model, mb, device, opts).cpu() for mb in mbs.parts]
    return mbs.restore(torch.cat([v for v, dummy in zip(parts, mbs.dummy) if not dummy]))


LossFn = Callable[[Batch, float], tuple[torch.Tensor, dict[str, float]]]
"""(micro-batch, weight of this micro-batch in its mini-batch) -> (scaled loss to backprop, metrics)."""


def optimize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: Batch,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    max_grad_norm: float,
    loss_fn: LossFn,
    prefix: str,
    loss_agg_mode: str = "token-mean",
    max_token_len: int | None = None,
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch optimizer steps with gradient accumulation over micro-batches.

    Each micro-batch's loss is weighted by its share of the mini-batch (valid tokens for `token-mean`,
    sequences for the sequence-level modes), so accumulating equals one pass over the whole mini-batch, whatever
    the micro-batches are: fixed-count, or token-budget ones with `max_token_len` (dynamic batching). A non-finite
    loss or gradient norm skips that optimizer step (gradients dropped, counted in `<prefix>/skipped_updates`); the
    caller decides when to stop.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    skipped = nonfinite_loss = nonfinite_grad = 0
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            by_tokens = loss_agg_mode == "token-mean"
            total = float(mini["response_mask"].sum().clamp(min=1)) if by_tokens else float(len(mini))
            loss_sum = 0.0
            mbs = make_micro_batches(mini, micro_batch_size, max_token_len)
            for mb, dummy in zip(mbs.parts, mbs.dummy):
                weight = (float(mb["response_mask"].sum()) if by_tokens else float(len(mb))) / total
                loss, mb_metrics = loss_fn(mb, 0.0 if dummy else weight)
                loss.backward()  # a dummy's zero-weight backward keeps this rank in the FSDP collectives
                if dummy:
                    continue
                loss_sum += float(loss.detach())
                for k, v in mb_metrics.items():
                    metrics[k].append(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            grad_norm_value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            loss_ok = all_finite(loss_sum)
            grad_ok = all_finite(grad_norm_value)
            if loss_ok and grad_ok:
                optimizer.step()
                metrics[f"{prefix}/grad_norm"].append(grad_norm_value)
            else:  # the gradients are dropped: nothing non-finite reaches the optimizer
                skipped += 1
                nonfinite_loss += int(not loss_ok)
                nonfinite_grad += int(loss_ok and not grad_ok)
                optimizer.zero_grad(set_to_none=True)
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
        mini_batch_size=spec.mini_batch_size,
        micro_batch_size=spec.micro_batch_size,
        epochs=spec.epochs,
        max_grad_norm=spec.max_grad_norm,
        loss_fn=loss_fn,
        prefix=prefix,
        loss_agg_mode=spec.loss_avg_mode,
        max_token_len=trainable.spec.forward.max_token_len,
    )
