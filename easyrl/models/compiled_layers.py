"""`torch.compile` per decoder layer (`worker.actor.model.compile_layers`, issue 44 item 3).

The other route to Liger's kernels (`easyrl.models.fused_kernels`): inductor fuses each decoder layer's elementwise
work (RMSNorm, SwiGLU, RoPE, residual adds, casts) for every family, on any device inductor serves (CUDA through
Triton, the CPU through C++). One layer class compiles once and every layer of the model reuses the graph (its
parameters are graph inputs), so the compile cost is one layer's, not the model's.

How it is applied, and why:

* `nn.Module.compile` in place, not `torch.compile(module)`: the latter wraps the layer in an `OptimizedModule`
  whose parameters are named `_orig_mod.*`, which would leak into checkpoints, merges and the weight stream to the
  engine. In place, every name stays the Hugging Face one.
* After gradient checkpointing is enabled and before FSDP2's `fully_shard` (the order torchtitan uses): transformers'
  checkpointing wraps the layer's `__call__` around the compiled forward, so the recompute replays the compiled
  graph; FSDP2's hooks stay outside the compiled region (dynamo skips FSDP hooks by default).
* `dynamic=True`: micro-batches differ in token count on every step; one graph with symbolic lengths serves them
  all instead of a recompile per shape.
* A linear-attention (Gated DeltaNet) token mixer is kept out of the graph too: it recurs over each packed sample
  (`easyrl.models.linear_attention`: data-dependent sample counts and lengths, a loop over chunks on transformers'
  reference path), and traced whole the tiny Qwen3.5 did not finish compiling in 7 minutes. Excluded, its layers
  compile in seconds around it (the norms, the MLP or experts, the residuals) and need no recompile.
* The text decoder layers only (class names ending in ``DecoderLayer``): a vision tower's blocks split their rows
  per image with data-dependent lengths, which would recompile per image count.
* A packed (padding-free) attention is kept out of the graph (`torch.compiler.disable`): it cuts the row at the
  sequence starts read from ``position_ids`` (a host sync and, on CPU, a loop over sequences), which dynamo would
  otherwise unroll and recompile for every number of sequences. The layer then compiles as a graph before the
  attention call and one after it; the attention itself is already one fused kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from easyrl.models.linear_attention import linear_attention_layers


logger = logging.getLogger(__name__)

TRACED_ATTENTIONS = frozenset({"sdpa", "eager"})
"""Attention implementations left inside the compiled graph: padded rows, a mask built outside the layers, no
data-dependent shapes."""


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder layers of `model` that `compile_decoder_layers` compiles (the vision and audio blocks are
    not decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names and type(m).__name__.endswith("DecoderLayer")]


def compile_decoder_layers(model: nn.Module, key: str) -> int:
    """Compile each text decoder layer of `model` in place (`dynamic=True`); returns how many. Refuses in one line,
    naming `key`, a model without decoder layers to compile."""
    layers = compiled_layers(model)
    if not layers:
        raise ValueError(
            f"{key}: no decoder layers found in {type(model).__name__} to compile: set it to false (or use "
            "liger_kernels on a Qwen2/Qwen3 model on a GPU)"
        )
    _keep_packed_attention_eager(model)
    _keep_linear_attention_eager(model)
    for layer in layers:
        layer.compile(dynamic=True)
    logger.info("torch.compile on %d decoder layers of %s (%s)", len(layers), type(model).__name__, key)
    return len(layers)


def _keep_packed_attention_eager(model: nn.Module) -> None:
    """Register the model's packed attention again, excluded from compilation (module docstring). transformers'
    registry is global to the process: any model naming it gets the excluded one, which computes the same thing."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = model.config
    implementations = {getattr(config, "_attn_implementation", None)}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementations.add(getattr(text, "_attn_implementation", None))
    for name in implementations:
        if name is None or name in TRACED_ATTENTIONS or name not in ALL_ATTENTION_FUNCTIONS:
            continue
        function = ALL_ATTENTION_FUNCTIONS[name]
        if getattr(function, "_easyrl_eager", False):  # already excluded by an earlier model of this process
            continue
        eager: Any = torch.compiler.disable(function)
        eager._easyrl_eager = True
        AttentionInterface.register(name, eager)


def _keep_linear_attention_eager(model: nn.Module) -> None:
    """Exclude each linear-attention (Gated DeltaNet) token mixer from the graph (module docstring): the layer
    compiles around it, as around the packed attention. Its `forward` is by then the instance's own (the packed
    samples' wrapper, `keep_samples_apart`), so the exclusion wraps that one."""
    for mixer in linear_attention_layers(model):
        if not getattr(mixer.forward, "_easyrl_eager", False):
            eager: Any = torch.compiler.disable(mixer.forward)
            eager._easyrl_eager = True
            mixer.forward = eager
