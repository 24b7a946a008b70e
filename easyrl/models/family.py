"""The model families easyrl trains: one frozen profile per ``model_type``, read wherever a family differs.

A forward path, a layout, a config check or the memory plan never tests a ``model_type`` string: it asks
:func:`family_of` and reads a field (does the model take ``logits_to_keep``, may the fused head replace its LM head,
does it take ``mm_token_type_ids``, which engines and features it was run through, its media token arithmetic).
Adding a family is one entry in :data:`FAMILIES` (docs/architecture.md, "A model family"). A ``model_type`` not
in it trains as a dense text decoder with the profile's defaults (what the listed text families share: most Hugging Face
causal LMs, as before the table), and the run says so in one warning before it starts (``easyrl.check``).

Torch-free on purpose: the config's checks read it (``easyrl check`` fails before torch is imported), and the token
arithmetic below works on ints and tensors alike (it only uses ``//``, ``%``, ``+`` and ``*``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


__all__ = [
    "FAMILIES",
    "MEDIA_FAMILIES",
    "FamilyProfile",
    "MediaFamily",
    "TinyModel",
    "UnknownFamilyError",
    "audio_output_tokens",
    "family_of",
    "media_family",
    "unlisted_family",
    "unlisted_family_warning",
]


# ------------------------------------------------------------------------------------------ media token arithmetic


def _qwen2_5_omni_audio_tokens(frames: Any) -> Any:
    """Qwen2.5-Omni: the audio encoder's conv (stride 2), then a stride-2 pool."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


QWEN3_OMNI_CHUNK = 100
"""Mel frames per chunk of Qwen3-Omni's audio encoder (``2 * n_window``; its processor counts with n_window 50)."""


def _qwen3_omni_audio_tokens(frames: Any) -> Any:
    """Qwen3-Omni MoE: 100-frame chunks, each through three stride-2 convs (13 tokens per full chunk), and the
    remainder chunk alone."""
    rest = frames % QWEN3_OMNI_CHUNK
    after_convs = (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    return after_convs + (frames // QWEN3_OMNI_CHUNK) * 13


@dataclass(frozen=True)
class MediaFamily:
    """What a processor family does with media (``VisionSpec.family``): every family makes one image (video) pad per
    merged patch, ``t * h * w / merge_size**2``; these are the ways they differ."""

    name: str
    """The family's name, as ``VisionSpec.family`` and error messages give it."""
    processor_class: str
    """The transformers processor class (a model folder that names none gets it from its family)."""
    frame_timestamps: bool = False
    """Qwen3-VL: a ``<t seconds>`` timestamp in the text before every video frame, and no ``second_per_grid_ts``."""
    videos: bool = True
    """Videos are built for it (an Omni model's video pads interleave with its audio track: not yet)."""
    audio_tokens: Callable[[Any], Any] | None = None
    """``<|AUDIO|>`` tokens of a clip of ``frames`` mel frames, as its processor and ``get_rope_index`` count them;
    None: the family takes no audio."""

    @property
    def takes_audio(self) -> bool:
        return self.audio_tokens is not None


MEDIA_FAMILIES: dict[str, MediaFamily] = {
    m.processor_class: m
    for m in (
        MediaFamily("qwen2_vl", "Qwen2VLProcessor"),
        MediaFamily("qwen2_5_vl", "Qwen2_5_VLProcessor"),
        MediaFamily("qwen3_vl", "Qwen3VLProcessor", frame_timestamps=True),
        MediaFamily("qwen2_5_omni", "Qwen2_5OmniProcessor", videos=False, audio_tokens=_qwen2_5_omni_audio_tokens),
        MediaFamily("qwen3_omni_moe", "Qwen3OmniMoeProcessor", videos=False, audio_tokens=_qwen3_omni_audio_tokens),
    )
}
"""Processor class -> its media family."""


def media_family(name: str) -> MediaFamily:
    """The :class:`MediaFamily` called ``name`` (``VisionSpec.family``)."""
    for media in MEDIA_FAMILIES.values():
        if media.name == name:
            return media
    raise ValueError(
        f"unknown media family {name!r}; expected one of {sorted(m.name for m in MEDIA_FAMILIES.values())}"
    )


def audio_output_tokens(feature_frames: Any, family: str = "qwen2_5_omni") -> Any:
    """``<|AUDIO|>`` tokens for a clip of ``feature_frames`` mel frames (an int or a tensor of them) in the media
    ``family`` (``qwen2_5_omni``, ``qwen3_omni_moe``)."""
    count = media_family(family).audio_tokens
    if count is None:
        raise ValueError(f"the {family} processor takes no audio")
    return count(feature_frames)


# ------------------------------------------------------------------------------------------------------ profiles


@dataclass(frozen=True)
class TinyModel:
    """How the tests build the family's tiny random model: ``builder(path, **kwargs)``."""

    builder: str
    """``module:function`` of the builder (under ``easyrl.testing``)."""
    kwargs: tuple[tuple[str, str], ...]
    """Its arguments besides the folder (the architecture's name)."""


@dataclass(frozen=True)
class FamilyProfile:
    """What a family's ``model_type`` means to the code that reads it (defaults: a dense text model whose forward
    takes everything the trainer passes)."""

    model_type: str
    title: str
    """Its name in messages (``Qwen2.5-Omni thinker``)."""
    tiny: TinyModel | None
    """None for a ``model_type`` outside the table (:func:`family_of`): it has no tiny model and no recipe."""
    media: MediaFamily | None = None
    """The processor family of a vision-language (or audio) model; None: a text model."""
    thinker: bool = False
    """An Omni thinker: it merges audio and images in its own forward, its ``get_rope_index`` takes the audio lengths
    (and no token types), it keeps ``rope_deltas`` on the top model and its text model is its ``model`` attribute."""
    logits_to_keep: bool = True
    """Its forward takes ``logits_to_keep`` (packed rows then compute logits only at the predicted positions)."""
    mm_token_types: bool = True
    """A vision-language forward takes ``mm_token_type_ids`` (Qwen-VL needs it whenever grids are passed)."""
    vllm_embeds: bool = False
    """vLLM's embedding inputs (tower outputs + grids in place of pixels) give it the prompt its pixels give: the grid
    alone sizes the placeholders (`easyrl.rollout.media_embeds`; Qwen3-VL's also need timestamps and deepstack)."""
    qkv_bias: bool = False
    """q/k/v projections carry biases when the config does not say (``attention_bias`` absent: Qwen2 always has them)."""
    qk_norm: bool = False
    """RMS norms on queries and keys (Qwen3 on)."""
    liger: str | None = None
    """Liger-Kernel's patch function for it (``liger_kernel.transformers.monkey_patch``), which
    ``worker.actor.model.liger_kernels`` applies (``easyrl.models.fused_kernels``); None: not wired, refused."""
    audio_n_window: int | None = None
    """The ``audio_config.n_window`` its audio token arithmetic assumes; None: any."""
    refuses: tuple[tuple[str, str], ...] = ()
    """(capability, why) for what it was not run through (``vllm``; the config check's ``_REFUSED_KEYS`` names the
    key each capability is asked for by)."""

    def refusal(self, capability: str) -> str | None:
        """Why ``capability`` is refused for this family, or None where it is supported."""
        return dict(self.refuses).get(capability)


def _text(model_type: str, title: str, **kw: Any) -> FamilyProfile:
    return FamilyProfile(model_type, title, TinyModel("easyrl.testing.tiny:build_tiny_checkpoint", (("arch", model_type),)), **kw)  # fmt: skip


def _vl(model_type: str, title: str, media: str, **kw: Any) -> FamilyProfile:
    tiny = TinyModel("easyrl.testing.tiny_vl:build_tiny_vl_checkpoint", (("arch", model_type),))
    return FamilyProfile(model_type, title, tiny, media=MEDIA_FAMILIES[media], **kw)


_THINKER_REFUSES = (
    ("vllm", "vllm is not wired for the Omni thinker's audio inputs (nor can vLLM's CPU build serve it); use "
     "worker.rollout.name=hf"),
)  # fmt: skip


def _thinker(model_type: str, title: str, media: str, variant: str, **kw: Any) -> FamilyProfile:
    tiny = TinyModel("easyrl.testing.tiny_omni:build_tiny_omni_checkpoint", (("variant", variant),))
    # the thinker's forward merges its audio: no logits_to_keep (the fused head runs that forward with an identity
    # head, `easyrl.workers.packing`), no token types (they would reach its attention as kwargs)
    return FamilyProfile(
        model_type, title, tiny, media=MEDIA_FAMILIES[media], thinker=True, logits_to_keep=False,
        mm_token_types=False, refuses=_THINKER_REFUSES, **kw,
    )  # fmt: skip


FAMILIES: dict[str, FamilyProfile] = {
    p.model_type: p
    for p in (
        _text("qwen2", "Qwen2 / Qwen2.5", qkv_bias=True, liger="apply_liger_kernel_to_qwen2"),
        _text("qwen3", "Qwen3", qk_norm=True, liger="apply_liger_kernel_to_qwen3"),
        _text("qwen3_moe", "Qwen3 MoE", qk_norm=True),
        _text("llama", "Llama"),
        _vl("qwen2_5_vl", "Qwen2.5-VL", "Qwen2_5_VLProcessor", qkv_bias=True, vllm_embeds=True),
        # the Qwen3-VL MoE and Qwen3.5 families ship Qwen3-VL's processor (as transformers' processing_auto maps them)
        _vl("qwen3_vl", "Qwen3-VL", "Qwen3VLProcessor", qk_norm=True),
        _vl("qwen3_vl_moe", "Qwen3-VL MoE", "Qwen3VLProcessor", qk_norm=True),
        _vl("qwen3_5", "Qwen3.5", "Qwen3VLProcessor", qk_norm=True),
        _vl("qwen3_5_moe", "Qwen3.5 MoE", "Qwen3VLProcessor", qk_norm=True),
        _thinker("qwen2_5_omni_thinker", "Qwen2.5-Omni thinker", "Qwen2_5OmniProcessor", "qwen2_5_omni", qkv_bias=True),
        # the audio token counts (as transformers' processor) assume 100-frame chunks
        _thinker("qwen3_omni_moe_thinker", "Qwen3-Omni MoE thinker", "Qwen3OmniMoeProcessor", "qwen3_omni_moe",
                 qk_norm=True, audio_n_window=50),
    )
}  # fmt: skip
"""``model_type`` -> its profile: the families easyrl trains (docs/models.md's support table)."""

NOT_TRAINED = {
    "qwen2_5_omni": "the whole Qwen2.5-Omni (thinker, talker and vocoder); easyrl trains its thinker (text out): save "
    "the thinker alone with its processor first (docs/models.md, Omni) and point model_path at that folder",
    "qwen3_omni_moe": "the whole Qwen3-Omni MoE (thinker, talker and code2wav); easyrl trains its thinker (text out): "
    "save the thinker alone with its processor first (docs/models.md, Omni) and point model_path at that folder",
}
"""``model_type``s that hold a trainable family inside them, and what to do instead."""


class UnknownFamilyError(ValueError):
    """A ``model_type`` that holds a trained family inside it (:data:`NOT_TRAINED`): what to train instead."""


def family_of(model: Any) -> FamilyProfile:
    """The profile of ``model``: a ``model_type`` string, a HF config, or a model (FSDP- or PEFT-wrapped is fine)."""
    config = model if isinstance(model, str) else getattr(model, "config", model)
    model_type = config if isinstance(config, str) else getattr(config, "model_type", None)
    profile = FAMILIES.get(str(model_type))
    if profile is not None:
        return profile
    if model_type in NOT_TRAINED:
        raise UnknownFamilyError(f"model_type {model_type!r} is {NOT_TRAINED[str(model_type)]}")
    return unlisted_family(str(model_type))


@functools.cache
def unlisted_family(model_type: str) -> FamilyProfile:
    """The profile of a ``model_type`` outside :data:`FAMILIES`: the defaults, a dense text decoder whose forward takes
    ``logits_to_keep`` (every causal LM of transformers 5 does). Refusing it would break the Llama-, Mistral- or
    Gemma-style models that trained before the table existed; `unlisted_family_warning` says it is untested."""
    return FamilyProfile(model_type, model_type, tiny=None)


def unlisted_family_warning(model_type: str) -> str | None:
    """The one warning a run gives for a ``model_type`` outside the table (None for a listed one)."""
    if model_type in FAMILIES:
        return None
    return (
        f"model_type {model_type!r} has no family profile: it trains as a dense text decoder, which no test or recipe "
        "covers; add its profile to FAMILIES in easyrl/models/family.py (docs/architecture.md, 'A model family')"
    )
