"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet): each sample keeps its own recurrent state.

A padding-free micro-batch is one row holding several samples back to back, the position ids restarting at 0 at each
sample (`easyrl.workers.packing`). Softmax attention layers cut the row there (`easyrl_varlen`, flash-attention's
``cu_seqlens``). A Gated DeltaNet layer has no attention to cut: it runs a short causal convolution and a recurrence
over the whole row, and transformers' layer (5.19) takes no sequence boundaries on its reference path: it drops
``cu_seq_lens_q`` on the floor unless the flash-linear-attention and causal-conv1d kernels are installed, and the
decoder layer never hands it the position ids. Left alone, sample k+1 would start from sample k's final state and
read its last three tokens through the convolution: log-probs off by up to 8e-4 on the tiny test model, far more with
slowly decaying state (tests/models/test_linear_attention.py).

:func:`keep_samples_apart` closes that in the model's own process, for any kernel: a pre-hook on the text model reads
the sample boundaries from the text position ids of a packed call (``attention_mask`` None, one row, more than one
position 0), and each linear-attention layer of that pass runs its samples as a right-padded batch (n, longest, H)
with their padding mask, then puts the outputs back in packed order. Right padding is exact for a causal layer (a
token sees only what precedes it; the layer zeroes the padded positions' inputs anyway). The cost is the padding of
the linear layers' batch, at most (n * longest - T) tokens; the softmax attention layers stay varlen. With the
flash-linear-attention kernels installed on a GPU, handing them ``cu_seqlens`` would avoid even that padding: not done,
since the padded batch is exact on every kernel and version.

Sequence parallelism cuts the row into slices before the layers: a recurrent layer would need the state at the start
of its slice from the rank before. Not supported: the config check and the worker stop such a run with one line
(:data:`SEQUENCE_PARALLEL_REFUSAL`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


__all__ = ["SEQUENCE_PARALLEL_REFUSAL", "has_linear_attention", "keep_samples_apart", "linear_attention_layers"]

_STATE = "easyrl_packed_boundaries"
"""Where the pass's sample boundaries hang on each linear-attention layer (one shared holder per model)."""


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The token mixers of `model` that run a recurrence (Qwen3.5 / Qwen3-Next ``linear_attn``: Gated DeltaNet)."""
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "linear_attn"]


SEQUENCE_PARALLEL_REFUSAL = (
    "splits each row over ranks, but this model's linear-attention (Gated DeltaNet) layers carry a recurrent state "
    "along the whole row, which a slice cannot start from; set it to 1"
)
"""Why ``ulysses_size`` > 1 is refused for a model with linear-attention layers (after the size, under the key)."""


def has_linear_attention(config: Any) -> bool:
    """Whether an HF config (or its ``config.json`` as a dict; a VL config's text part included) has linear-attention
    layers."""
    config = getattr(config, "config", config)
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    text = get("text_config") or config
    layer_types = text.get("layer_types") if isinstance(text, dict) else getattr(text, "layer_types", None)
    return "linear_attention" in (layer_types or [])


class _Boundaries:
    """The current packed pass's sample starts (int64 offsets, ``[0, ..., T]``), or None outside one."""

    def __init__(self) -> None:
        self.cu: torch.Tensor | None = None


def _text_positions(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """(T,) text positions of a packed call (one row, no mask), or None for any other call."""
    if kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return None
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor):
        return None
    if pos.dim() == 3:
        # (4, 1, T): the text row first, then M-RoPE (a packed VL row); (3, 1, T) carries no boundaries
        if pos.shape[0] != 4:
            return None
        pos = pos[0]
    if pos.dim() != 2 or pos.shape[0] != 1:
        return None
    return pos[0]


def _capture() -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The holder hangs on the module the hook runs for, not in a closure: a copy of the model (`copy.deepcopy`)
        # keeps the hook function itself but gets its own holder, shared with its own layers.
        holder: _Boundaries = getattr(module, _STATE)
        holder.cu = None  # one sequence (or a padded batch): the layer's own path is exact
        pos = _text_positions(kwargs)
        if pos is None:
            return
        starts = torch.nonzero(pos == 0).reshape(-1)
        if starts.numel() > 1 and int(starts[0]) == 0:
            holder.cu = torch.cat([starts, starts.new_tensor([pos.numel()])])

    return hook


def _unpacked_forward(
    original: Any, cu: torch.Tensor, hidden_states: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """`original` (the layer's own forward) on the samples of the packed (1, T, H) row as a right-padded batch."""
    lengths = cu.diff()
    n, width, total = lengths.numel(), int(lengths.max()), int(cu[-1])
    sample = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths)
    # each packed token's place in the (n, width) grid: its sample's row, its offset from the sample's start
    flat = (sample * width + torch.arange(total, device=cu.device) - cu[:-1][sample]).to(hidden_states.device)
    h = hidden_states.shape[-1]
    grid = hidden_states.new_zeros(n * width, h).index_copy(0, flat, hidden_states[0]).view(n, width, h)
    mask = torch.zeros(n * width, dtype=torch.long, device=flat.device).index_fill(0, flat, 1).view(n, width)
    out = original(grid, attention_mask=mask, **kwargs)
    return out.reshape(n * width, -1).index_select(0, flat)[None]


def _wrap(layer: nn.Module, holder: _Boundaries) -> None:
    # The layer's forward as a function of the layer (transformers' kernel hub may have swapped it), called on `self`
    # below, and the holder read from `self`: a deep copy of the model then runs its own layers with its own holder
    # (a bound method or a holder in this closure would keep pointing at the original model's).
    bound = layer.forward
    original: Any = getattr(bound, "__func__", None)
    if original is None or getattr(bound, "__self__", None) is not layer:  # not a method of this layer: as it is

        def original(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return bound(*args, **kwargs)

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cu = getattr(self, _STATE).cu
        cache = kwargs.get("cache_params", args[0] if args else None)
        if cu is None or cache is not None or hidden_states.shape[0] != 1 or hidden_states.shape[1] != int(cu[-1]):
            return original(self, hidden_states, *args, **kwargs)
        if args:
            raise RuntimeError(f"{type(self).__name__} was called with positional inputs; expected keywords")
        if kwargs.get("attention_mask") is not None:
            raise RuntimeError("a packed row reached a linear-attention layer with a padding mask")
        rest = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "cache_params")}
        return _unpacked_forward(types.MethodType(original, self), cu.to(hidden_states.device), hidden_states, rest)

    layer.forward = types.MethodType(forward, layer)  # type: ignore[method-assign]
    setattr(layer, _STATE, holder)


def keep_samples_apart(model: nn.Module) -> int:
    """Install the boundary hooks (module doc) on `model` if it has linear-attention layers; returns how many layers
    were wrapped (0: nothing to do). Call once, after loading and before sharding (the hooks survive FSDP2)."""
    layers = [m for m in linear_attention_layers(model) if not hasattr(m, _STATE)]
    if not layers:
        return 0
    holder = _Boundaries()
    # The modules that own a stack of decoder layers among which a linear-attention one: the text models, which every
    # forward path (the fused head's backbone call, a VL critic's backbone) enters with the text positions.
    owners = [
        m
        for m in model.modules()
        if isinstance(stack := getattr(m, "layers", None), nn.ModuleList)
        and any(isinstance(getattr(layer, "linear_attn", None), nn.Module) for layer in stack)
    ]
    if not owners:
        raise ValueError(f"{type(model).__name__}: linear-attention layers outside a decoder stack (no .layers)")
    for owner in owners:
        setattr(owner, _STATE, holder)
        owner.register_forward_pre_hook(_capture(), with_kwargs=True)
    for layer in layers:
        _wrap(layer, holder)
    return len(layers)
