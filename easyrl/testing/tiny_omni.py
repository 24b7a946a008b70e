"""A tiny, random-init Qwen2.5-Omni *thinker* (audio encoder, vision tower, text model; text output only) with a
local processor: the character tokenizer of :mod:`easyrl.testing.tiny` plus the Omni special tokens, the PIL image
processor and a ``WhisperFeatureExtractor`` built in memory (nothing is downloaded).

The audio encoder is 2 layers, 32 wide, over 16 mel bins; the feature extractor pads every clip to
``chunk_seconds`` (2 s at 16 kHz: 200 mel frames, 50 ``<|AUDIO|>`` tokens for a full clip) where the published one
pads to 30 s, so a test's forward stays small. The text model is the 2-layer, 64-wide model of the other tiny
builders. Saved as an ordinary folder (``model_type: qwen2_5_omni_thinker``) that
``AutoModelForImageTextToText`` and :func:`easyrl.models.load_processor` load back.
"""

from __future__ import annotations

import json
import os
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from easyrl.models.processor import build_processor
from easyrl.testing.tiny import IM_END, PAD_TOKEN, make_tokenizer, padded_vocab_size


__all__ = ["OMNI_CHAT_TEMPLATE", "OMNI_TOKENS", "build_tiny_omni_checkpoint", "make_omni_processor", "write_tone_wav"]

OMNI_TOKENS = {
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}
"""The Omni processor's special tokens, by the tokenizer attribute it reads each from (as Qwen2.5-Omni names them)."""

OMNI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with Qwen2.5-Omni's media parts: an audio part is ``<|audio_bos|><|AUDIO|><|audio_eos|>``."""

SAMPLING_RATE = 16000
MEL_BINS = 16
PATCH_SIZE = 8


def make_omni_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny character tokenizer plus the Omni special tokens, which the processor finds as attributes."""
    tokenizer = make_tokenizer()
    tokens = list(OMNI_TOKENS.values())
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
    # Qwen2.5-Omni's tokenizer_config names them as model-specific special tokens: the processor reads
    # tokenizer.audio_token and the rest, and they are saved with the tokenizer
    tokenizer._set_model_specific_special_tokens(special_tokens=dict(OMNI_TOKENS))
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE
    return tokenizer


def make_omni_processor(
    tokenizer: PreTrainedTokenizerFast, chunk_seconds: int = 2, processor_class: str = "Qwen2_5OmniProcessor"
) -> Any:
    """Image processor (PIL, 8-pixel patches), Whisper feature extractor (16 mel bins, clips padded to
    ``chunk_seconds``) and ``tokenizer`` as an Omni processor (``processor_class``) without a video processor."""
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128
    )
    features = WhisperFeatureExtractor(
        feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160, chunk_length=chunk_seconds, n_fft=400
    )
    return build_processor(processor_class, image_processor, tokenizer, OMNI_CHAT_TEMPLATE, feature_extractor=features)


def build_tiny_omni_checkpoint(
    path: str | os.PathLike[str], seed: int = 0, chunk_seconds: int = 2, variant: str = "qwen2_5_omni"
) -> str:
    """Build the thinker, its tokenizer and processor into one folder; returns ``path``. ``variant``:
    ``qwen2_5_omni`` (dense) or ``qwen3_omni_moe`` (4 experts, 2 per token; its audio encoder cuts the mel frames
    into 100-frame chunks, 13 tokens per full chunk)."""
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_VARIANTS)}, got {variant!r}")
    config_cls, model_cls, processor_class = _VARIANTS[variant]
    tokenizer = make_omni_tokenizer()
    processor = make_omni_processor(tokenizer, chunk_seconds, processor_class)
    ids: dict[str, Any] = {name: tokenizer.convert_tokens_to_ids(token) for name, token in OMNI_TOKENS.items()}
    pad_id, eos_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)
    config = config_cls(**_config_kwargs(variant, padded_vocab_size(tokenizer), ids, pad_id, eos_id))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = model_cls._from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # One preprocessor_config.json holds both the image processor's and the feature extractor's fields, as the
    # published Omni folders' do (each Auto class reads its own *_type).
    merged = {**processor.feature_extractor.to_dict(), **processor.image_processor.to_dict()}
    merged.pop("mel_filters", None)  # recomputed from the sizes when loaded
    merged["processor_class"] = processor_class
    _write_json(os.path.join(path, "preprocessor_config.json"), merged)
    _write_json(os.path.join(path, "processor_config.json"), {"processor_class": processor_class})
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(OMNI_CHAT_TEMPLATE)
    return path


_VARIANTS: dict[str, tuple[Any, Any, str]] = {
    "qwen2_5_omni": (Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration, "Qwen2_5OmniProcessor"),
    "qwen3_omni_moe": (
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
        "Qwen3OmniMoeProcessor",
    ),
}


def _config_kwargs(variant: str, vocab: int, ids: dict[str, Any], pad_id: Any, eos_id: Any) -> dict[str, Any]:
    """The thinker config's fields: a 2-layer, 64-wide text model, a 1-block vision tower and a 2-layer audio
    encoder over 16 mel bins, for either variant."""
    hidden, heads = 64, 4
    half = hidden // heads // 2
    text: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,  # room for a recipe's prompt and response lengths
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
        },
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    vision: dict[str, Any] = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
    }
    audio: dict[str, Any] = {
        "num_mel_bins": MEL_BINS,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": hidden,
        "n_window": 50,  # Qwen3-Omni's processor counts tokens with 50 (100-frame chunks) whatever the config says
        "max_source_positions": 1500,
    }
    if variant == "qwen3_omni_moe":
        text |= {"head_dim": hidden // heads, "moe_intermediate_size": hidden, "num_experts": 4}
        text |= {"num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True}
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
        audio |= {"downsample_hidden_size": 8}
        tokens = {"audio_token_id": ids["audio_token"], "image_token_id": ids["image_token"]}
        tokens |= {"video_token_id": ids["video_token"]}
    else:
        vision |= {"window_size": PATCH_SIZE * 4, "fullatt_block_indexes": [0]}
        tokens = {"audio_token_index": ids["audio_token"], "image_token_index": ids["image_token"]}
        tokens |= {"video_token_index": ids["video_token"], "audio_end_token_id": ids["audio_eos_token"]}
    return {
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "audio_start_token_id": ids["audio_bos_token"],
        "tie_word_embeddings": False,
        **tokens,
        # not declared fields of the thinker's config, but its get_rope_index reads them (as the hub config has them)
        "vision_start_token_id": ids["vision_bos_token"],
        "vision_end_token_id": ids["vision_eos_token"],
    }


def _write_json(file: str, data: dict[str, Any]) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def write_tone_wav(path: Path, seconds: float, rate: int, tone: float = 440.0, channels: int = 1) -> Path:
    """Write a 16-bit PCM sine of `seconds` at `rate` Hz (the same signal on every channel) to `path`."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * tone * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.repeat(pcm, channels).tobytes())
    return path
