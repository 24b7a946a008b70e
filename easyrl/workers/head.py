"""The one forward head: a micro-batch -> per-response-token log-probs and entropy (policy) or values (critic).

Every path goes through the same three steps, so they agree by construction:

1. Layout (`easyrl.workers.packing.prepare_inputs`): the padded rows as they are (plain), trimmed padded rows, or
   one packed row; each names the positions whose output predicts a response token (`select`) and where each
   result goes in the (b, R) grid (`dest`).
2. Head (`_run_head`): one model call on the layout, then the selected positions only: the value head's one output,
   or log-probs and entropy of `scale_logits(logits, temperature)` (full logits of the selected positions, or the
   fused chunked head of `easyrl.workers.packing`, which scales its chunks with the same `scale_logits`).
3. Scatter the (N,) results into (b, R).

Ulysses sequence parallelism is a layout transform around step 2 (`easyrl.workers.ulysses.split_forward`): the
packed row is sharded over the group, the same head runs on the local tokens, and the selected results are gathered
back before step 3. Its group is the `SequenceParallel` object attached to the model when it was built.

The plain layout keeps the model's outputs at padding (the others give 0 there); only valid tokens are ever read.

`top_k_log_probs` and `token_log_probs_at` (on-policy distillation's `topk_fkl`: a teacher's k most likely tokens,
and the student's log-probs at them with their gradient) read (N, V) logits on the same layouts, unfused and unsplit
only: the fused head's backward and the Ulysses gather carry one value per position.
"""

from __future__ import annotations

import torch
from torch import nn

from easyrl.algorithms import entropy_from_logits, logprobs_from_logits, scale_logits
from easyrl.batch import Batch
from easyrl.models.family import family_of
from easyrl.workers.packing import ModelInputs, fused_forward, prepare_inputs
from easyrl.workers.specs import ForwardOptions
from easyrl.workers.ulysses import sequence_parallel_of, split_forward


__all__ = ["response_values", "token_log_probs", "token_log_probs_and_top1", "token_log_probs_at", "top_k_log_probs"]


def _selected_logits(model: nn.Module, inputs: ModelInputs, value_head: bool) -> torch.Tensor:
    """One model call on the layout `inputs`: the full logits (N, V) at its selected positions (unscaled)."""
    packed = inputs.attention_mask is None  # only the packed layout passes no mask
    # Packed rows, log-probs: `logits_to_keep` (a tensor of positions) makes the model compute logits only there.
    # (A value model has no such argument, and its head is one output wide anyway.)
    # Packed only: the positions index the token dim (1) of the hidden states, which is the flat index for one row.
    # A family whose forward takes no `logits_to_keep` (the Omni thinker) computes every position's logits
    takes_keep = packed and not value_head and family_of(model).logits_to_keep
    keep = {"logits_to_keep": inputs.select} if takes_keep else {}
    out = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **keep,
        **inputs.media,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1])  # (rows * width, V), or (N, V) with `logits_to_keep`
    if not keep:  # every position was computed: pick the selected ones
        logits = logits.index_select(0, inputs.select)
    return logits


def _run_head(
    model: nn.Module,
    inputs: ModelInputs,
    *,
    temperature: float | None,
    second: str | None,
    fused: bool,
    chunk_size: int,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward on the layout `inputs`: (N,) at its selected positions, and (N,) of the `second` statistic
    (`entropy`, or `top1`: 1.0 where the label is the argmax, for SFT's token accuracy) or None.

    `temperature` None: the value head (a one-output token classifier), read as is. Otherwise the sampled tokens'
    log-probs under logits / temperature.
    """
    if temperature is not None and fused:
        # The fused head computes the entropy of each chunk it already holds anyway: a metric costs a detach only
        kind = "top1" if second == "top1" else "entropy"
        lp, stat = fused_forward(model, inputs, temperature, chunk_size, kind, head_kernel)
        return lp, (None if second is None else stat.detach() if second == ENTROPY_METRIC else stat)
    logits = _selected_logits(model, inputs, value_head=temperature is None)
    if temperature is None:
        return logits[:, 0].float(), None  # the value head's one output (num_labels=1)
    z = scale_logits(logits, temperature)
    lp = logprobs_from_logits(z, inputs.labels)
    if second == "top1":
        return lp, (z.argmax(dim=-1) == inputs.labels).float()
    return lp, _entropy_of(z, second)


ENTROPY_METRIC = "entropy_metric"
"""The `second` statistic that is the entropy as a metric: no graph, so no gradient and no saved tensors."""


def _entropy_of(z: torch.Tensor, second: str | None) -> torch.Tensor | None:
    """The (N,) entropy of the scaled logits `z` (N, V) for `second` "entropy" (differentiable), `ENTROPY_METRIC`
    (detached) or None (not computed)."""
    if second == ENTROPY_METRIC:
        # Chunk by chunk under no_grad: one (chunk, V) fp32 block at a time beside the logits the loss holds anyway
        with torch.no_grad():
            return entropy_from_logits(z.detach())
    return entropy_from_logits(z) if second == "entropy" else None


def _forward(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    opts: ForwardOptions | None,
    temperature: float | None,
    second: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layout, head (split over the sequence-parallel group when there is one), scatter: (b, R) each."""
    opts = opts or ForwardOptions()
    if temperature is not None:
        scale_logits(torch.zeros(0), temperature)  # refuse greedy (0) before the forward pass, on every path
    # laid out on the host, moved in one go
    inputs = prepare_inputs(mb, opts.padding_free, model, trim=not opts.plain).to(device)

    def head(layout: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _run_head(
            model,
            layout,
            temperature=temperature,
            second=second,
            fused=opts.fused,
            chunk_size=opts.chunk_size,
            head_kernel=opts.head_kernel,
        )

    sp = sequence_parallel_of(model) if opts.sp_size > 1 else None
    if opts.sp_size > 1 and sp is None:
        raise RuntimeError(
            f"ulysses_size={opts.ulysses_size}, ring_size={opts.ring_size} but the model has no sequence-parallel group: build it with "
            "enable_sequence_parallel(...) and SequenceParallel.attach(model)"
        )
    out, ent = head(inputs) if sp is None else split_forward(sp, model, inputs, head)
    return inputs.scatter(out), (None if ent is None else inputs.scatter(ent))


def token_log_probs(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    opts: ForwardOptions | None = None,
    *,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token under `model` at `temperature` (> 0): (b, R), and its entropy (b, R).

    `opts` picks the layout (padded, trimmed or packed, split over a sequence-parallel group) and the head (full
    logits or fused chunks); every path gives the same values at valid response tokens, for text and
    vision-language rows alike. The non-plain paths give 0 at padding. `entropy_grad=False`: the entropy is a
    detached metric, computed from the same forward without a graph (the update's `actor/entropy` without a bonus).
    """
    return _forward(model, mb, device, opts, temperature, _entropy_kind(with_entropy, entropy_grad))


def _entropy_kind(with_entropy: bool, entropy_grad: bool) -> str | None:
    """The head's `second` statistic for these flags."""
    return None if not with_entropy else "entropy" if entropy_grad else ENTROPY_METRIC


def token_log_probs_and_top1(
    model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each response token under `model` (temperature 1): (b, R), and (b, R) 1.0 where the token is the
    model's first choice (its logits' argmax), 0.0 elsewhere and at padding: what SFT trains and its token accuracy.
    The same layouts and heads as `token_log_probs`."""
    lp, top1 = _forward(model, mb, device, opts, 1.0, "top1")
    assert top1 is not None
    return lp, top1


def response_values(
    model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions | None = None
) -> torch.Tensor:
    """A value model's estimate of the state before each response token: (b, R), zeros at padding."""
    values, _ = _forward(model, mb, device, opts, None, None)
    # Zero at padding on every layout (the plain one computes it there); which tokens train is `loss_mask`'s call.
    return values * mb["response_mask"].to(device)


TOPK_CHUNK = 1024
"""Positions per float32 log-softmax in `top_k_log_probs` (the teacher's forward, no gradient)."""


def _unfused_layout(
    model: nn.Module, mb: Batch, device: torch.device, opts: ForwardOptions | None, temperature: float
) -> ModelInputs:
    """The layout of the top-k heads below: full logits only (the fused head's custom backward carries the sampled
    token's gradient alone) and no sequence-parallel split (its gather carries one value per position)."""
    opts = opts or ForwardOptions()
    if opts.fused or opts.sp_size > 1:
        raise ValueError(
            "top-k log-probs need the unfused, unsplit head: set worker.actor.fused_logprobs=false, "
            "worker.actor.ulysses_size=1 and worker.actor.ring_size=1"
        )
    scale_logits(torch.zeros(0), temperature)  # refuse greedy (0) before the forward pass
    return prepare_inputs(mb, opts.padding_free, model, trim=not opts.plain).to(device)


def top_k_log_probs(
    model: nn.Module, mb: Batch, device: torch.device, temperature: float, k: int, opts: ForwardOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's log-prob (b, R), and the model's k most likely tokens at each response position: their
    log-probs (b, R, k) and ids (b, R, k) int64, all at `temperature`; zeros at padding (ids 0 there)."""
    inputs = _unfused_layout(model, mb, device, opts, temperature)
    z = scale_logits(_selected_logits(model, inputs, value_head=False), temperature)
    parts = []
    # A float32 log-softmax of `chunk` positions at a time: no second (N, V) tensor beside the logits.
    for rows, labels in zip(z.split(TOPK_CHUNK), inputs.labels.split(TOPK_CHUNK)):
        logp = torch.log_softmax(rows.float(), dim=-1)
        top_lp, top_ids = logp.topk(k, dim=-1)  # (chunk, k) each
        parts.append((logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), top_lp, top_ids))
    sampled, top_lp, top_ids = (torch.cat(p) for p in zip(*parts))
    return inputs.scatter(sampled), inputs.scatter(top_lp), inputs.scatter(top_ids)


def token_log_probs_at(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    temperature: float,
    ids: torch.Tensor,
    with_entropy: bool,
    opts: ForwardOptions | None = None,
    *,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`token_log_probs` (b, R) and entropy, and the log-probs (b, R, k) at the token `ids` (b, R, k) of each
    response position (another model's top-k: `top_k_log_probs`), all differentiable (the entropy detached with
    `entropy_grad=False`); zeros at padding."""
    inputs = _unfused_layout(model, mb, device, opts, temperature)
    z = scale_logits(_selected_logits(model, inputs, value_head=False), temperature)
    lp = logprobs_from_logits(z, inputs.labels)
    # log p(j) = z_j - logsumexp(z) at the k ids: (N, k) and (N, 1), no (N, V) log-softmax beside the logits
    zf = z.float()
    at = zf.gather(-1, inputs.gather(ids.to(device))) - torch.logsumexp(zf, dim=-1, keepdim=True)
    ent = _entropy_of(z, _entropy_kind(with_entropy, entropy_grad))
    return inputs.scatter(lp), (None if ent is None else inputs.scatter(ent)), inputs.scatter(at)
