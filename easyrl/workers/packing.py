"""Model inputs without padding work, and the fused (chunked) log-prob/entropy head.

Two layouts feed the same computation: *trimmed padded* rows (columns that are padding in every row removed) and
*packed* rows (padding-free: the valid tokens of all samples concatenated into one row, `position_ids` restarting
at 0 for each sample). In both, only the hidden states that predict a valid response token are selected (`select`)
and the per-token results are scattered back into a (b, R) grid (`dest`), zeros at padding.

Vision-language rows take both layouts too: the rows' patches and grids ride along (`ModelInputs.media`, stacked in
row order) and the positions are M-RoPE, computed per sample on its own valid tokens; a packed row's are (4, 1, T),
the 1D text positions first, from which the attention finds the sequence starts (docs/vision_language.md).

Packed attention: with `attention_mask=None` and packed `position_ids`, the attention must stay inside each
sequence. Models are loaded for it (`packed_attn_implementation`) with `flash_attention_2` when the flash-attn
package is installed (its integration derives `cu_seqlens` from the position ids), else with easyrl's own
`easyrl_varlen` (`easyrl.workers.varlen`: torch's flash varlen kernel on CUDA, per-sequence sdpa on CPU). The sdpa
default would also be exact (transformers builds a block-diagonal mask from the position ids) but computes attention
over the whole packed row.

Fused head: logits are never materialized for all tokens. `FusedLinearLogProbs` computes, chunk by chunk over the
tokens, `hidden @ W.T` in the model's dtype, then fp32 log-softmax, the sampled token's log-prob and the entropy; its
backward recomputes the logits by blocks of vocabulary columns (`easyrl.workers.head_grad`: no (V, H) sum). Under FSDP2 the head weight (possibly tied to the embedding) belongs to the root
unit and is only unsharded inside the root's forward, so the whole computation runs as a method of the root module
registered with `register_fsdp_forward_method`: FSDP's pre-forward all-gathers the root's parameters and its
backward hooks reduce-scatter their gradients exactly as for the usual `forward`. `worker.actor.fused_head_kernel:
triton` swaps the per-chunk row-wise work for `easyrl.workers.head_kernel`'s Triton kernels (same contract).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from easyrl.algorithms import scale_logits
from easyrl.batch import Batch
from easyrl.models.family import family_of
from easyrl.models.vision import is_vision_language, multimodal_forward_kwargs
from easyrl.models.vl_tower import entering_backbone
from easyrl.workers.head_grad import backward_by_vocab_blocks


FUSED_METHOD = "easyrl_fused_logprobs"
"""Name of the fused head method attached to (and registered with FSDP2 on) the root module."""


def packed_attn_implementation() -> str:
    """The attention implementation to load models with for padding-free training: flash-attention 2 on CUDA
    when the package is installed, else easyrl's varlen attention (torch's flash varlen kernel on CUDA, per-sequence
    sdpa elsewhere; see `easyrl.workers.varlen`). Both attend within each packed sequence only, with no mask."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    from easyrl.workers.varlen import register_varlen_attention

    return register_varlen_attention()


@dataclass
class ModelInputs:
    """One micro-batch laid out for the model, with the positions to read results from."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """None when packed (transformers then derives the block-diagonal mask from `position_ids`)."""
    select: torch.Tensor
    """(N,) flat indices into the (rows * width) positions whose outputs predict a valid response token."""
    labels: torch.Tensor
    """(N,) the response token each selected position predicts."""
    dest: torch.Tensor
    """(N,) flat indices into the (b * R) response grid."""
    grid: tuple[int, int]
    """(b, R)."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Vision-language models: the rows' patches and grids (in row order) and ``mm_token_type_ids`` laid out like
    ``input_ids``; passed to the model as keyword arguments. Empty for text models."""

    def to(self, device: torch.device) -> ModelInputs:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return ModelInputs(
            self.input_ids.to(device),
            self.position_ids.to(device),
            mask,
            self.select.to(device),
            self.labels.to(device),
            self.dest.to(device),
            self.grid,
            {k: v.to(device) for k, v in self.media.items()},
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(N, ...) per selected position -> (b, R, ...) grid, zeros at padding (differentiable)."""
        b, r = self.grid
        rest = values.shape[1:]
        return values.new_zeros(b * r, *rest).index_copy(0, self.dest, values).view(b, r, *rest)

    def gather(self, grid: torch.Tensor) -> torch.Tensor:
        """(b, R, ...) grid -> (N, ...) at the selected positions: `scatter`'s inverse."""
        return grid.reshape(self.grid[0] * self.grid[1], *grid.shape[2:]).index_select(0, self.dest)


def prepare_inputs(mb: Batch, padding_free: bool, model: nn.Module | None = None, trim: bool = True) -> ModelInputs:
    """Lay out `mb` (left-padded prompts, right-padded responses) packed, as trimmed padded rows, or (`trim` off)
    as the padded rows themselves with every response column selected (the plain path: padding included, so its
    results at padding are the model's, not 0).

    With a vision-language `model` the layout carries the rows' media and 3D (M-RoPE) positions, computed per row
    on its own valid tokens: trimmed rows get (3, b, W); a packed row gets (4, 1, T), the 1D text positions first
    (restarting at 0 at each sample: what the attention reads the sequence boundaries from, transformers' Qwen-VL
    convention for packed rows), then the temporal/height/width rows.
    """
    input_ids, mask = mb["input_ids"], mb["attention_mask"].bool()
    media, mrope = _vision_inputs(mb, model)
    b, length = input_ids.shape
    r = mb["responses"].shape[1]
    p = length - r  # prompt columns (left-padded); the last R columns are the right-padded responses
    if not padding_free and not trim:
        # Every (row, response column), padding too: position P - 1 + col of row `row` predicts column `col`.
        rows, cols = torch.arange(b).repeat_interleave(r), torch.arange(r).repeat(b)
        select, labels, dest = rows * length + cols + p - 1, mb["responses"].flatten(), rows * r + cols
        # A VL row's M-RoPE positions are computed from its media: the batch needs no 1D ones then.
        position_ids = mb["position_ids"] if mrope is None else mrope
        return ModelInputs(input_ids, position_ids, mb["attention_mask"], select, labels, dest, (b, r), media)
    pos = mb["position_ids"]
    if pos.dim() != 2:
        raise ValueError(f"the batch's position_ids must be (b, L) 1D positions, got shape {tuple(pos.shape)}")
    rows, cols = mask[:, p:].nonzero(as_tuple=True)  # valid response tokens
    labels = mb["responses"][rows, cols]
    dest = rows * r + cols
    # Always a valid token: column P - 1 is the prompt's last (left padding) and a valid response token follows only
    # valid ones (right padding), so the packed index and the trimmed window below both hold it.
    source = cols + p - 1  # the position whose output predicts response token `cols`
    if padding_free:
        # Where each (row, column) lands in the packed row (meaningful at valid positions only): boolean indexing
        # (`input_ids[mask]`) keeps the same row-major order as this running count.
        packed_pos = mask.flatten().long().cumsum(0) - 1
        select = packed_pos[rows * length + source]
        # (1, T): each sample's positions restart at 0, where the attention cuts the row
        position_ids = pos[mask][None]
        if mrope is not None:
            position_ids = torch.cat([position_ids, mrope[:, mask]])[:, None]  # (4, 1, T)
            if "mm_token_type_ids" in media:  # the Omni thinker takes none
                media["mm_token_type_ids"] = media["mm_token_type_ids"][mask][None]
        return ModelInputs(input_ids[mask][None], position_ids, None, select, labels, dest, (b, r), media)
    # The columns that are padding in every row sit at the two ends (left-padded prompts, right-padded responses), so
    # one [left, right) window drops them all.
    used = mask.any(dim=0).nonzero()
    left, right = int(used.min()), int(used.max()) + 1
    width = right - left
    select = rows * width + (source - left)
    position_ids = pos[:, left:right] if mrope is None else mrope[:, :, left:right]
    if mrope is not None and "mm_token_type_ids" in media:
        media["mm_token_type_ids"] = media["mm_token_type_ids"][:, left:right]
    return ModelInputs(
        input_ids[:, left:right], position_ids, mask[:, left:right].long(), select, labels, dest, (b, r), media
    )


def _vision_inputs(mb: Batch, model: nn.Module | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A VL model's extra inputs for `mb` (patches, grids, ``mm_token_type_ids`` (b, L)) and its 3D positions
    (3, b, L); ``({}, None)`` for a text model. Text-only rows of a VL model get three copies of the 1D positions."""
    if model is None or not is_vision_language(model):
        if "multi_modal_inputs" in mb and any(mb["multi_modal_inputs"]):
            raise ValueError("the micro-batch carries images or videos: lay it out with its vision-language model")
        return {}, None
    media: dict[str, torch.Tensor] = multimodal_forward_kwargs(mb, model)
    # None when the micro-batch has no media (`multimodal_forward_kwargs` returns {})
    mrope = media.pop("position_ids", None)
    if mrope is None:
        # Text-only micro-batch: a text token's M-RoPE position is its 1D position on all three axes, and every token
        # is text (type 0); set so the layouts below treat every VL micro-batch alike.
        mrope = mb["position_ids"].unsqueeze(0).expand(3, -1, -1)
        if family_of(model).mm_token_types:
            media["mm_token_type_ids"] = torch.zeros_like(mb["input_ids"], dtype=torch.int)
    return media, mrope


def _chunk_stats(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, ...]:
    """fp32 logits / temperature of one chunk, their log-sum-exp, log-prob of `labels` and entropy."""
    z = scale_logits(h @ w.T, temperature)  # (chunk, V): the matmul in the model's dtype, then fp32 / T
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, labels[:, None]).squeeze(1) - lse
    # H = -sum p log p = lse - sum p z; `mul_` into p: two fp32 (chunk, V) blocks at most (z and p), as the plan counts
    entropy = lse - torch.exp(z - lse[:, None]).mul_(z).sum(dim=-1)
    return z, lse, logp, entropy


class FusedLinearLogProbs(torch.autograd.Function):
    """(N, H) hidden, (V, H) head weight, (N,) labels -> (N,) log-probs and (N,) second statistic, fp32, by token
    chunks. The second is the entropy, or with `second="top1"` 1.0 where the label is the argmax (SFT's token
    accuracy; no gradient).

    Memory: one (chunk, V) fp32 block at a time in forward and backward; the backward recomputes the logits by
    blocks of vocabulary columns (`easyrl.workers.head_grad`), from two floats per row kept by the forward.
    Gradients: d logp/dz = onehot - p and d H/dz = -p (z - E_p[z]) for z = logits / temperature.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk: int,
        second: str = "entropy",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logps, seconds, lses, mean_zs = [], [], [], []
        for h, lab in zip(hidden.split(chunk), labels.split(chunk)):
            z, lse, logp, ent = _chunk_stats(h, weight, lab, temperature)
            logps.append(logp)
            seconds.append(ent if second == "entropy" else (z.argmax(dim=-1) == lab).float())
            lses.append(lse)
            mean_zs.append(lse - ent)  # E_p[z] = lse - H
        # No selected token (a micro-batch of empty responses): torch.cat refuses an empty list.
        empty = hidden.new_zeros(0, dtype=torch.float32)
        lse, mean_z = (torch.cat(x) if x else empty for x in (lses, mean_zs))
        # Two floats per row, never a (chunk, V) block: the backward recomputes the logits.
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.temperature, ctx.chunk, ctx.second = temperature, chunk, second
        return (torch.cat(logps) if logps else empty), (torch.cat(seconds) if seconds else empty)

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        g_lp = None if grad_logp is None else grad_logp.float()
        g_h = None if grad_ent is None or ctx.second != "entropy" else grad_ent.float()  # a top-1 flag: no gradient

        def grad_block(start: int, end: int, logits: torch.Tensor) -> torch.Tensor:
            z = scale_logits(logits, temperature)  # (N, c) fp32
            p = torch.exp(z - lse[:, None])
            grad_z = torch.zeros_like(z) if g_lp is None and g_h is None else None
            if g_h is not None:
                # dH / dz = -p (z - E_p[z]), written over z (not read again)
                grad_z = z.sub_(mean_z[:, None]).mul_(p).mul_(-g_h[:, None])
            if g_lp is not None:
                # d logp / dz = onehot(label) - p: the -p part over p, then the labels that fall in this block
                term = p.mul_(-g_lp[:, None])
                grad_z = term if grad_z is None else grad_z.add_(term)
                # every row adds at a column of this block: its label's, or nothing (0 at column 0) for a label
                # elsewhere; a scatter with no `nonzero`, so no host sync per block on a GPU
                inside = (labels >= start) & (labels < end)
                cols = (labels - start).clamp(0, end - start - 1)[:, None]
                grad_z.scatter_add_(1, cols, torch.where(inside, g_lp, 0.0)[:, None])
            assert grad_z is not None
            if temperature != 1.0:
                grad_z.div_(temperature)  # chain rule through z = logits / T
            return grad_z.to(weight.dtype)  # both matmuls run in the model's dtype, as the forward's

        grads = backward_by_vocab_blocks(hidden, weight, ctx.chunk, grad_block, ctx.needs_input_grad[:2])
        return *grads, None, None, None, None  # labels, temperature, chunk, second: no gradient


HEAD_KERNELS = ("torch", "triton")
"""`worker.actor.fused_head_kernel`: the fused head's row-wise work in torch (fp32 (chunk, V) blocks, any device) or
in Triton (`easyrl.workers.head_kernel`: the logits block read once in the model's dtype, CUDA)."""


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int,
    second: str = "entropy",
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and entropy (or with `second="top1"` whether the label is the argmax) under
    `hidden @ weight.T / temperature`, without full logits; `kernel` one of `HEAD_KERNELS`."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if second not in ("entropy", "top1"):
        raise ValueError(f"second must be 'entropy' or 'top1', got {second!r}")
    if kernel not in HEAD_KERNELS:
        raise ValueError(f"worker.actor.fused_head_kernel={kernel!r}: choose one of {', '.join(HEAD_KERNELS)}")
    scale_logits(hidden.new_zeros(0), temperature)  # refuse greedy (0) before any work, as every head does
    if kernel == "triton":
        return _triton_head()(hidden, weight, labels, temperature, chunk_size, second)
    out = FusedLinearLogProbs.apply(hidden, weight, labels, temperature, chunk_size, second)
    return out[0], out[1]


def _triton_head() -> Any:
    """`easyrl.workers.head_kernel.triton_linear_logprobs`, imported on first use: triton is an optional extra."""
    try:
        from easyrl.workers.head_kernel import triton_linear_logprobs
    except ImportError as exc:
        raise RuntimeError(
            f"worker.actor.fused_head_kernel=triton: cannot import triton ({exc}): pip install -e '.[gpu]', or set "
            "it to torch"
        ) from None
    return triton_linear_logprobs


def _fused_method(
    self: nn.Module,
    inputs: ModelInputs,
    temperature: float,
    chunk_size: int,
    second: str = "entropy",
    kernel: str = "torch",
) -> tuple[Any, Any]:
    """Backbone forward, then the fused head on the selected positions. Runs as a method of the root module so
    FSDP2 unshards the root's parameters (embedding, final norm, head) around it."""
    head: Any = self.lm_head  # type: ignore[attr-defined]
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("the fused head supports a bias-free lm_head only")
    call = {
        "input_ids": inputs.input_ids,
        "attention_mask": inputs.attention_mask,
        "position_ids": inputs.position_ids,
        "use_cache": False,
        **inputs.media,
    }
    if family_of(self).thinker:
        # An Omni thinker merges its audio and images in its own forward, before its text model: that forward runs,
        # with an identity in place of the head, so its `logits` are the last hidden states. `forward` itself, not
        # the module call: FSDP2's hooks around this method already gathered the root's parameters. So the one
        # other pre-hook on it, keeping the towers in step over the ranks, runs here.
        entering_backbone(self, call)
        with _identity_head(self):
            hidden = self.forward(**call).logits
    else:
        # The backbone alone (`self.model`): the root's own forward would compute the full logits this head avoids.
        hidden = self.model(**call).last_hidden_state  # type: ignore[operator]
    # (N, H): `select` indexes the flattened (rows * width) positions
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.select)
    return fused_linear_logprobs(selected, head.weight, inputs.labels, temperature, chunk_size, second, kernel)


@contextmanager
def _identity_head(model: nn.Module) -> Iterator[None]:
    """`model.lm_head` is an identity for the block; the head module (and its parameter, which FSDP2 tracks through
    it) is put back after."""
    head = model.lm_head
    model.lm_head = nn.Identity()
    try:
        yield
    finally:
        model.lm_head = head


def fused_forward(
    model: nn.Module,
    inputs: ModelInputs,
    temperature: float,
    chunk_size: int,
    second: str = "entropy",
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) log-probs and entropy (or top-1 flags, `second="top1"`) of the selected positions through the fused
    head (attaching it on first use), its row-wise work on `kernel` (`HEAD_KERNELS`)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not hasattr(model, FUSED_METHOD):
        if not (hasattr(model, "model") and hasattr(model, "lm_head")):
            raise NotImplementedError(f"fused log-probs need a causal LM with .model and .lm_head, not {type(model)}")
        setattr(model, FUSED_METHOD, types.MethodType(_fused_method, model))
        register_fsdp_forward_method(model, FUSED_METHOD)  # a no-op for unsharded models
    return getattr(model, FUSED_METHOD)(inputs, temperature, chunk_size, second, kernel)
