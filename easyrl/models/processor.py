"""Loading vision-language processors, with or without torchvision.

transformers 5 builds the Qwen2-VL family's *video* processor on torchvision, and ``AutoProcessor.from_pretrained``
loads every sub-processor, so on a machine without torchvision (CPU boxes, minimal images) loading any Qwen2.5-VL or
Qwen3-VL processor fails even when only images are needed. :func:`load_processor` falls back to the same processor
class built with the PIL image processor and no video processor; videos are then patchified by
:mod:`easyrl.data.multimodal` itself (it does so in both cases, so the two set-ups give the same tokens).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from easyrl.models.family import FAMILIES, MEDIA_FAMILIES, MediaFamily, media_family


__all__ = ["VisionSpec", "build_processor", "load_processor", "vision_spec"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionSpec:
    """What the media pipeline needs to know about a processor (patch geometry, special tokens, family)."""

    family: str
    """The processor's media family (``qwen2_5_vl``, ``qwen3_vl``, ``qwen2_5_omni``...: ``MediaFamily.name``)."""
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    @property
    def media(self) -> MediaFamily:
        """How the family differs in its media tokens (`easyrl.models.family.MEDIA_FAMILIES`)."""
        return media_family(self.family)

    @property
    def factor(self) -> int:
        """Image sides are multiples of this many pixels (one merged patch)."""
        return self.patch_size * self.merge_size


def vision_spec(processor: Any) -> VisionSpec:
    """The :class:`VisionSpec` of a loaded Qwen2-VL / Qwen2.5-VL / Qwen3-VL processor."""
    name = type(processor).__name__
    media = next((m for cls, m in MEDIA_FAMILIES.items() if name.startswith(cls)), None)
    if media is None:
        # Subclasses (e.g. the image-only fallback) keep the family of their base class.
        bases = [b.__name__ for b in type(processor).__mro__]
        media = next((MEDIA_FAMILIES[b] for b in bases if b in MEDIA_FAMILIES), None)
    if media is None:
        raise ValueError(f"unsupported vision-language processor {name}; expected one of {sorted(MEDIA_FAMILIES)}")
    ip = processor.image_processor
    return VisionSpec(
        family=media.name,
        patch_size=int(ip.patch_size),
        merge_size=int(ip.merge_size),
        temporal_patch_size=int(ip.temporal_patch_size),
        image_mean=tuple(float(x) for x in ip.image_mean),
        image_std=tuple(float(x) for x in ip.image_std),
        image_token=getattr(processor, "image_token", "<|image_pad|>"),
        video_token=getattr(processor, "video_token", "<|video_pad|>"),
        # the Omni processor names its vision markers bos/eos
        vision_start=str(
            getattr(processor, "vision_start_token", None)
            or getattr(processor, "vision_bos_token", "<|vision_start|>")
        ),
        vision_end=str(
            getattr(processor, "vision_end_token", None) or getattr(processor, "vision_eos_token", "<|vision_end|>")
        ),
    )


def _image_only_class(cls: Any) -> Any:
    """``cls`` with a constructor that accepts ``video_processor=None`` (its type check needs torchvision)."""

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    new_cls = type(
        f"{cls.__name__}ImageOnly", (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class}
    )
    return new_cls


def build_processor(
    processor_class: str,
    image_processor: Any,
    tokenizer: Any,
    chat_template: str | None = None,
    feature_extractor: Any = None,
) -> Any:
    """An image-only processor of class ``processor_class`` (e.g. ``Qwen2_5_VLProcessor``): no video processor.
    An Omni processor (``Qwen2_5OmniProcessor``) also takes the audio ``feature_extractor``."""
    import transformers

    cls = getattr(transformers, processor_class)
    extra = {} if feature_extractor is None else {"feature_extractor": feature_extractor}
    return _image_only_class(cls)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template,
        **extra,
    )


def _processor_class_name(path: str) -> str:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                value = json.load(f).get("processor_class")
            if value:
                return str(value)
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
        family = FAMILIES.get(str(model_type))
        if family is not None and family.media is not None:
            return family.media.processor_class
    raise ValueError(f"{path}: cannot tell the processor class (no processor_class, no known model_type)")


def load_processor(path: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """Load the processor saved at ``path``; ``None`` when the folder has no image processor (a text model).

    Tries ``AutoProcessor.from_pretrained`` first; if that fails for want of torchvision (the video processor),
    builds the same processor class with the PIL image processor and no video processor.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    path = str(path)
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        logger.info("%s: no torchvision, loading the processor without its video processor", path)
    image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    chat_template = getattr(tokenizer, "chat_template", None)
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            chat_template = f.read()
    name = _processor_class_name(path)
    features = None
    if name in MEDIA_FAMILIES and MEDIA_FAMILIES[name].takes_audio:  # the Omni processors hold a feature extractor
        from transformers import AutoFeatureExtractor

        features = AutoFeatureExtractor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return build_processor(name, image_processor, tokenizer, chat_template, feature_extractor=features)


def load_tokenizer(path: str | os.PathLike[str], trust_remote_code: bool = False) -> tuple[Any, Any]:
    """``(tokenizer, processor)`` of the model at ``path``, as the trainer and ``easyrl check`` both use them: a
    vision-language model's tokenizer is its processor's (``processor`` is ``None`` for a text model), and a
    tokenizer without a pad token pads with its end-of-sequence token."""
    from transformers import AutoTokenizer

    processor = load_processor(path, trust_remote_code=trust_remote_code)
    if processor is not None:
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # batches are padded; the end token is never trained on as padding
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, processor


def vocabulary_difference(ours: Any, theirs: Any) -> str | None:
    """How the vocabularies of two tokenizers differ (`None` when every token has the same id in both): token ids
    only, so a teacher whose end-of-turn token or chat template differs but whose ids agree (an instruct model over
    its base) passes."""
    a, b = ours.get_vocab(), theirs.get_vocab()
    if a == b:
        return None
    moved = sorted(t for t in a.keys() & b.keys() if a[t] != b[t])
    only_ours, only_theirs = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    parts = [f"{len(a)} vs {len(b)} tokens"]
    if moved:
        shown = ", ".join(f"{t!r} {a[t]} vs {b[t]}" for t in moved[:3])
        parts.append(f"{len(moved)} with other ids (e.g. {shown})")
    if only_ours:
        parts.append(f"{len(only_ours)} only in the first (e.g. {', '.join(map(repr, only_ours[:3]))})")
    if only_theirs:
        parts.append(f"{len(only_theirs)} only in the second (e.g. {', '.join(map(repr, only_theirs[:3]))})")
    return "; ".join(parts)
