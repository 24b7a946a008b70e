"""The weights an engine is sent, in the layout of the model's checkpoint files rather than of transformers' memory.

transformers 5 converts some checkpoints as it loads them (`conversion_mapping.py`): routed experts stored one matrix
per expert (Qwen3 MoE, Qwen3.5 MoE: ``mlp.experts.<e>.gate_proj.weight``, ...) become fused 3D tensors
(``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)), and Qwen3-VL MoE's fused tensors are
transposed (and Qwen2.5-VL's names move: its files keep the text model under ``model.``, the tower under
``visual.``). The policy streams its parameters under their in-memory names and layouts; an engine that loads checkpoint
files (vLLM's ``reload_weights(is_checkpoint_format=True)``) guesses at fused layouts it was not written for: a
Qwen3 MoE policy sent as is gave vLLM log-probs 11 nats off the policy's (tests/workers/test_rollout_engines.py). So
each tensor is put back the way ``save_pretrained`` would write it, with transformers' own reverse conversion, run on
one tensor at a time against a model built on the meta device (no memory, nothing gathered twice). Models without a
conversion pass through untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


__all__ = ["checkpoint_layout"]

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, torch.Tensor]]


def checkpoint_layout(hf_config: Any, trust_remote_code: bool = False) -> Callable[[Stream], Iterator[Any]] | None:
    """A function that turns a stream of (in-memory name, tensor) into (checkpoint name, tensor) for the model of
    `hf_config`; None when transformers loads that model's checkpoints without converting a tensor."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: memory and files agree
        return None
    from easyrl.models import model_class_for

    with torch.device("meta"):
        meta = model_class_for(hf_config).from_config(hf_config, trust_remote_code=trust_remote_code)
    # What `save_pretrained` reverts for a model it did not load (as `revert_weight_conversion` decides): the
    # renamings (Qwen2.5-VL's text model under `model.`, its tower under `visual.`) and the tensor conversions
    conversions = [c for c in get_model_conversion_mapping(meta, add_legacy=False) if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    logger.info("weights are sent in the checkpoint's layout (%d conversions reverted)", len(conversions))

    def convert(weights: Stream) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            # One tensor at a time: every conversion of these families reads a single tensor (split the experts,
            # transpose), so its reverse needs no other; the meta model only names the mapping.
            yield from revert_weight_conversion(meta, {name: tensor}).items()

    return convert
