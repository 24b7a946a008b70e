"""Tiny, random-init Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE) models with a local processor
(nothing is downloaded).

The language model is the 2-layer, 64-wide model of :mod:`easyrl.testing.tiny` (same character-level tokenizer, plus
the four vision special tokens): the MoE families route over 4 experts, 2 per token, and Qwen3.5's first layer is a
Gated DeltaNet (linear attention) layer, its second a full-attention one, as in the published hybrid. The vision
tower is one or two blocks, 32 wide, with 8-pixel patches and
``spatial_merge_size=2``, so a 64x48 image becomes 8x6 patches and 12 ``<|image_pad|>`` tokens. Everything is saved
as an ordinary Hugging Face folder that ``AutoModelForImageTextToText`` and
:func:`easyrl.models.load_processor` (``AutoProcessor`` where torchvision is installed) load back.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from tokenizers import AddedToken
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from easyrl.models.processor import build_processor
from easyrl.testing.tiny import IM_END, PAD_TOKEN, make_tokenizer, padded_vocab_size


__all__ = [
    "MOE_ARCHS",
    "VISION_TOKENS",
    "VL_ARCHS",
    "VL_CHAT_TEMPLATE",
    "VL_FAMILIES",
    "build_tiny_vl_checkpoint",
    "make_vl_config",
    "make_vl_processor",
    "make_vl_tokenizer",
]

logger = logging.getLogger(__name__)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Special tokens the Qwen VL processors and models use (ids 265-268 in the tiny tokenizer)."""

VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, with image/video parts rendered as Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``."""

# Qwen3-VL MoE and both Qwen3.5 families ship Qwen3-VL's processor (transformers' processing_auto maps them to it).
_ARCHS: dict[str, tuple[Any, type[PreTrainedModel], str]] = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor"),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, "Qwen3VLProcessor"),
    "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, "Qwen3VLProcessor"),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, "Qwen3VLProcessor"),
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, "Qwen3VLProcessor"),
}
VL_FAMILIES = tuple(_ARCHS)
"""Every architecture :func:`build_tiny_vl_checkpoint` knows (docs/models.md has a row for each)."""
VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")
"""The two dense Qwen-VL families the vision-language tests run in full (packing, Ulysses, the critic, vLLM); the
other families go through the same paths in tests/models/test_families.py."""
MOE_ARCHS = ("qwen3_vl_moe", "qwen3_5_moe")
"""The vision-language families with routed experts."""

PATCH_SIZE = 8
"""Vision patch side in pixels (real Qwen2.5-VL: 14, Qwen3-VL: 16)."""
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# Qwen2.5-VL normalises with CLIP's statistics, the Qwen3 generations with 0.5 on every channel.
_MEAN = {arch: (_CLIP_MEAN if arch == "qwen2_5_vl" else (0.5, 0.5, 0.5)) for arch in _ARCHS}
_STD = {arch: (_CLIP_STD if arch == "qwen2_5_vl" else (0.5, 0.5, 0.5)) for arch in _ARCHS}


def make_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny character-level tokenizer plus :data:`VISION_TOKENS` (special) and the VL chat template."""
    tokenizer = make_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def make_vl_processor(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2_5_vl",
    min_pixels: int = 32 * 32,
    max_pixels: int = 128 * 128,
    patch_size: int = PATCH_SIZE,
) -> Any:
    """An image processor (PIL backend, ``patch_size``-pixel patches) and ``tokenizer`` combined into the arch's
    processor."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {VL_FAMILIES}")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=list(_MEAN[arch]),
        image_std=list(_STD[arch]),
    )
    return build_processor(_ARCHS[arch][2], image_processor, tokenizer, VL_CHAT_TEMPLATE)


def make_vl_config(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2_5_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    tie_word_embeddings: bool = True,
    patch_size: int = PATCH_SIZE,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
) -> PretrainedConfig:
    """The model config (token ids from ``tokenizer``; ``mrope_section`` sized to the head dim). ``text_overrides`` /
    ``vision_overrides`` replace entries of the text / vision sub-configs (e.g. a public model's exact shape)."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {VL_FAMILIES}")
    # The newer families default to 2 query heads and 1 key/value head of size 32, which vLLM's CPU attention takes
    # (it refuses size 16); the two dense families keep the 4/2 heads their recorded tests were built with.
    default_heads = (4, 2) if arch in VL_ARCHS else (2, 1)
    num_heads = num_heads or default_heads[0]
    num_kv_heads = num_kv_heads or default_heads[1]
    head_dim = hidden_size // num_heads
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # t, h, w; sums to head_dim / 2
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    pad_id, eos_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)
    text: dict[str, Any] = {
        "vocab_size": padded_vocab_size(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    }
    vision: dict[str, Any] = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": 2,
        "patch_size": patch_size,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "out_hidden_size": hidden_size,
    }
    if arch == "qwen2_5_vl":
        vision |= {"window_size": patch_size * MERGE_SIZE * 2, "fullatt_block_indexes": [vision_depth - 1]}
    else:
        text |= {"head_dim": head_dim}
        text["rope_parameters"]["mrope_interleaved"] = True
        vision |= {"num_position_embeddings": 256}
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        vision |= {"deepstack_visual_indexes": [0]}
    text |= _newer_text(arch, hidden_size, head_dim, num_layers)
    text |= text_overrides or {}
    vision |= vision_overrides or {}
    config_cls = _ARCHS[arch][0]
    return config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )


def _newer_text(arch: str, hidden_size: int, head_dim: int, num_layers: int) -> dict[str, Any]:
    """The text settings of the MoE and hybrid families (none for the dense Qwen-VL ones)."""
    text: dict[str, Any] = {}
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text |= _hybrid_text(head_dim, num_layers)
    if arch in MOE_ARCHS:
        # 4 experts, 2 routed per token: enough for a top-k whose choice can flip between two numerics. Expert width
        # half the hidden size: a square expert matrix would load transposed without an error.
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size // 2}
        if arch == "qwen3_5_moe":
            text |= {"shared_expert_intermediate_size": hidden_size // 2}
        if arch == "qwen3_vl_moe":
            # The published checkpoints' config.json carries it and vLLM 0.26 reads it (`config.norm_topk_prob`); the
            # config class of transformers 5 does not declare it (its model always renormalises the top-k weights),
            # so a config built in code lacks it: vLLM then failed on the H200 (2026-11-26). True = what HF computes.
            text |= {"norm_topk_prob": True}
    return text


def _hybrid_text(head_dim: int, num_layers: int) -> dict[str, Any]:
    """Qwen3.5's text settings: linear-attention (Gated DeltaNet) layers with a full-attention layer closing every
    pair (the published models close every four), 2 key and 4 value heads of ``head_dim`` in the linear layers, and
    rotary embeddings on a quarter of each head (``partial_rotary_factor``), M-RoPE sections sized to it."""
    rotary_half = head_dim // 8  # head_dim * 0.25 / 2
    section = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    return {
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": section,
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
    }


def build_tiny_vl_checkpoint(
    path: str | os.PathLike[str],
    arch: str = "qwen2_5_vl",
    seed: int = 0,
    min_pixels: int = 32 * 32,
    max_pixels: int = 128 * 128,
    patch_size: int = PATCH_SIZE,
    dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> str:
    """Build a random-init VL model, its tokenizer and processor into one folder; returns ``path``.

    The folder holds the model (safetensors), ``generation_config.json``, the tokenizer, the image processor
    (``preprocessor_config.json``), a video processor config for machines with torchvision, ``processor_config.json``
    and the chat template. Load it with ``AutoModelForImageTextToText.from_pretrained(path)`` and
    :func:`easyrl.models.load_processor`.
    """
    tokenizer = make_vl_tokenizer()
    processor = make_vl_processor(tokenizer, arch, min_pixels, max_pixels, patch_size)
    config = make_vl_config(tokenizer, arch, patch_size=patch_size, **config_kwargs)
    model_cls = _ARCHS[arch][1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = model_cls._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    _write_json(os.path.join(path, "processor_config.json"), {"processor_class": _ARCHS[arch][2]})
    _write_json(
        os.path.join(path, "video_preprocessor_config.json"),
        {
            "video_processor_type": "Qwen2VLVideoProcessor" if arch == "qwen2_5_vl" else "Qwen3VLVideoProcessor",
            "processor_class": _ARCHS[arch][2],
            "patch_size": patch_size,
            "merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "image_mean": list(_MEAN[arch]),
            "image_std": list(_STD[arch]),
        },
    )
    logger.debug("built %s (%d parameters) at %s", arch, model.num_parameters(), path)
    return path


def _write_json(file: str, data: dict[str, Any]) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
