"""Model-side helpers for vision-language policies: processor loading, 3D positions, media in forward passes."""

from easyrl.models.processor import (
    VisionSpec,
    build_processor,
    load_processor,
    load_tokenizer,
    vision_spec,
    vocabulary_difference,
)
from easyrl.models.vision import (
    MEDIA_KEYS,
    freeze_vision_tower,
    generate_with_media,
    is_omni,
    is_vision_language,
    media_token_ids,
    mm_token_type_ids,
    model_class_for,
    mrope_position_ids,
    multimodal_forward_kwargs,
    stack_media,
    vision_tower,
)


__all__ = [
    "MEDIA_KEYS",
    "VisionSpec",
    "build_processor",
    "freeze_vision_tower",
    "generate_with_media",
    "is_omni",
    "is_vision_language",
    "load_processor",
    "load_tokenizer",
    "media_token_ids",
    "mm_token_type_ids",
    "model_class_for",
    "mrope_position_ids",
    "multimodal_forward_kwargs",
    "stack_media",
    "vision_spec",
    "vision_tower",
    "vocabulary_difference",
]
