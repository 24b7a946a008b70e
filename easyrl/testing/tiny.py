"""Tiny, real, locally built models for tests and demos (nothing is downloaded).

A character-level tokenizer (byte-level BPE without merges: every ASCII character is one token) with a ChatML chat template, and
random-init Qwen2 / Qwen3 / Qwen3-MoE / Llama causal LMs small enough to build in well under a second. Everything is
saved as ordinary Hugging Face folders, so the code under test loads them through `AutoTokenizer` /
`AutoModelForCausalLM` exactly like a hub checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
"""Padding token (also the model's `bos_token_id`; never prepended)."""
IM_START = "<|im_start|>"
"""Opens a chat turn."""
IM_END = "<|im_end|>"
"""Closes a chat turn; the EOS token."""
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, "<image>", "<video>"]
"""Special tokens (dropped by `decode(..., skip_special_tokens=True)`)."""
REASONING_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
"""Added non-special tokens: one id each, but kept when special tokens are skipped (like Qwen3's `<think>`)."""
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message; generation prompt `<|im_start|>assistant\\n`.
List contents (multimodal messages) render text parts as is and image/video parts as `<image>`/`<video>`."""

_ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
ARCHS = tuple(_ARCHS)
"""Architectures `build_model` knows."""

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in byte order (printable ASCII maps to itself, space to `Ġ`, newline to `Ċ`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer in memory (see `build_tokenizer`)."""
    vocab = {symbol: i for i, symbol in enumerate(_byte_alphabet())}
    # Byte-level BPE without merges: every byte (so every ASCII character) is one token. The pipeline is the same
    # as Qwen2's, so the folder loads identically whether transformers picks `Qwen2Tokenizer` (it does for
    # model_type qwen2) or the generic backend.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, "<image>", "<video>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer, save it to `path` and return it.

    Vocabulary: the 256 bytes, token id = byte value (so every ASCII character, space and newline included, is
    one token; other text is spelled out in UTF-8 bytes), then the special tokens `<|endoftext|>` (256, pad),
    `<|im_start|>` (257), `<|im_end|>` (258, eos), `<image>`, `<video>`, and the ordinary added tokens `<think>`,
    `</think>`, `<answer>`, `</answer>` (261-264). `decode(encode(s)) == s` for any NFC-normalised text. Padding is
    on the left and the chat template is ChatML. `AutoTokenizer.from_pretrained(path)` loads it back.
    """
    tokenizer = make_tokenizer()
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def padded_vocab_size(tokenizer: PreTrainedTokenizerFast, multiple: int = 16) -> int:
    """The tokenizer's size rounded up to a multiple of `multiple`."""
    return -(-len(tokenizer) // multiple) * multiple


def make_config(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype | str = torch.float32,
) -> PretrainedConfig:
    """The model config `build_model` uses (token ids taken from `tokenizer`)."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    vocab_size = vocab_size or padded_vocab_size(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    if isinstance(dtype, str):
        dtype = _DTYPES[dtype]
    config_cls, _ = _ARCHS[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "rms_norm_eps": 1e-6,
        "dtype": dtype,
    }
    if arch in ("qwen3", "qwen3_moe", "llama"):
        kwargs["head_dim"] = hidden_size // num_heads
    if arch == "qwen3_moe":
        # every layer sparse: 4 experts of half the hidden size (no square expert matrix, which would load transposed
        # without an error), 2 routed per token, top-k renormalised as published
        kwargs |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size // 2}
        kwargs |= {"decoder_sparse_step": 1, "norm_topk_prob": True}
    return config_cls(**kwargs)


def build_model(
    path: str | os.PathLike[str],
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> str:
    """Build a random-init causal LM and save it, with the tokenizer and a generation config, to `path`.

    `arch` is one of `qwen2`, `qwen3`, `qwen3_moe`, `llama`. `vocab_size` defaults to the tokenizer's size rounded up to a
    multiple of 16. The weights depend only on `seed` (same seed, same safetensors bytes). `tokenizer` defaults
    to `make_tokenizer()`. Returns `path` as a string.
    """
    tokenizer = tokenizer or make_tokenizer()
    config = make_config(
        tokenizer,
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
    )
    _, model_cls = _ARCHS[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(config.dtype)  # type: ignore[arg-type]
    model.generation_config = make_generation_config(tokenizer)
    save_checkpoint(model, tokenizer, path)
    logger.debug("built %s model (%d parameters) at %s", arch, model.num_parameters(), path)
    return str(path)


def make_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Generation config with the tokenizer's bos/eos/pad ids (sampling settings are left to the caller)."""
    return GenerationConfig(
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike[str]) -> None:
    """Save `model` (safetensors), its generation config and `tokenizer` into one Hugging Face folder."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))


def build_tiny_checkpoint(path: str | os.PathLike[str], arch: str = "qwen2", **kwargs: Any) -> str:
    """Build the tokenizer and a tiny random model into one folder (`kwargs` go to `build_model`)."""
    tokenizer = build_tokenizer(path)
    return build_model(path, arch=arch, tokenizer=tokenizer, **kwargs)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `build_tokenizer` (a thin wrapper over `AutoTokenizer.from_pretrained`)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
    return tokenizer


def build_reward_model(
    path: str | os.PathLike[str], seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **kwargs: Any
) -> str:
    """A random-init Qwen2 sequence classifier with one output (a reward model's shape), with the tokenizer, saved to
    `path` (`kwargs` go to `make_config`). Returns `path` as a string."""
    from transformers import Qwen2ForSequenceClassification

    tokenizer = tokenizer or make_tokenizer()
    config = make_config(tokenizer, arch="qwen2", **kwargs)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    save_checkpoint(model, tokenizer, path)
    return str(path)
