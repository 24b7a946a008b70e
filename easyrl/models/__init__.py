"""Model-side helpers: the model families (`family`), processor loading, 3D positions, media in forward passes.

The names below load their module on first use (PEP 562): `easyrl.models.family` is torch-free and the config's
checks read it, so importing it must not import the torch-heavy helpers beside it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from easyrl.models.family import FAMILIES, FamilyProfile, family_of
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
        is_vision_language,
        media_token_ids,
        mm_token_type_ids,
        model_class_for,
        mrope_position_ids,
        multimodal_forward_kwargs,
        stack_media,
        vision_tower,
    )

_HOMES = {
    "easyrl.models.family": ("FAMILIES", "FamilyProfile", "family_of"),
    "easyrl.models.processor": (
        "VisionSpec",
        "build_processor",
        "load_processor",
        "load_tokenizer",
        "vision_spec",
        "vocabulary_difference",
    ),
    "easyrl.models.vision": (
        "MEDIA_KEYS",
        "freeze_vision_tower",
        "generate_with_media",
        "is_vision_language",
        "media_token_ids",
        "mm_token_type_ids",
        "model_class_for",
        "mrope_position_ids",
        "multimodal_forward_kwargs",
        "stack_media",
        "vision_tower",
    ),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "FAMILIES",
    "MEDIA_KEYS",
    "FamilyProfile",
    "VisionSpec",
    "build_processor",
    "family_of",
    "freeze_vision_tower",
    "generate_with_media",
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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'easyrl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
