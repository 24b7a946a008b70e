"""The tiny random model of any family in `easyrl.models.family.FAMILIES`, by its `model_type`."""

from __future__ import annotations

import importlib
import os
from typing import Any

from easyrl.models.family import family_of


def build_tiny_family(path: str | os.PathLike[str], model_type: str, **kwargs: Any) -> str:
    """Build the tiny model of `model_type`'s family into `path` with the builder its profile names (`kwargs` go to
    that builder); returns `path`."""
    tiny = family_of(model_type).tiny
    if tiny is None:
        raise ValueError(
            f"model_type {model_type!r} has no tiny builder: it is not in easyrl/models/family.py's table"
        )
    module, _, function = tiny.builder.partition(":")
    builder = getattr(importlib.import_module(module), function)
    return str(builder(path, **dict(tiny.kwargs), **kwargs))
