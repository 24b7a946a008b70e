"""Forward passes and the mini-batch/micro-batch update loop shared by the actor, reference and critic roles."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from easyrl.algorithms import entropy_from_logits, logprobs_from_logits
from easyrl.protocol import Batch
from easyrl.workers.fsdp import all_finite


def response_logits(model: nn.Module, mb: Batch, device: torch.device) -> torch.Tensor:
    """Logits predicting each response token: (b, R, V) from a forward pass over prompt+response (b, P+R)."""
    response_len = mb["responses"].shape[1]
    out = model(
        input_ids=mb["input_ids"].to(device),
        attention_mask=mb["attention_mask"].to(device),
        position_ids=mb["position_ids"].to(device),
        use_cache=False,
    )
    return out.logits[:, -response_len - 1 : -1]


def token_log_probs(
    model: nn.Module, mb: Batch, device: torch.device, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token under `model` at `temperature`: (b, R), and its entropy (b, R)."""
    logits = response_logits(model, mb, device).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_probs = logprobs_from_logits(logits, mb["responses"].to(device))
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


@torch.no_grad()
def batched_log_probs(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float,
    micro_batch_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_log_probs` over a whole batch in micro-batches: (B, R) each, on CPU."""
    lps, ents = [], []
    for mb in batch.split(micro_batch_size):
        lp, ent = token_log_probs(model, mb, device, temperature, with_entropy)
        lps.append(lp.cpu())
        if ent is not None:
            ents.append(ent.cpu())
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


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
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch optimizer steps with gradient accumulation over micro-batches.

    Each micro-batch's loss is weighted by its share of the mini-batch (valid tokens for `token-mean`,
    sequences for the sequence-level modes), so accumulating equals one pass over the whole mini-batch. A non-finite loss or gradient norm skips that optimizer step
    (gradients dropped, counted in `<prefix>/skipped_updates`); the caller decides when to stop.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    skipped = nonfinite_loss = nonfinite_grad = 0
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            by_tokens = loss_agg_mode == "token-mean"
            total = float(mini["response_mask"].sum().clamp(min=1)) if by_tokens else float(len(mini))
            loss_sum = 0.0
            for mb in mini.split(micro_batch_size):
                weight = (float(mb["response_mask"].sum()) if by_tokens else float(len(mb))) / total
                loss, mb_metrics = loss_fn(mb, weight)
                loss.backward()
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
