"""Loading a reward function from a Python file given as ``path/to/file.py:function``.

The file is imported by path under a unique module name (two files both called ``math.py`` must not collide, and
neither may shadow the standard library), and its directory is appended to ``sys.path`` so helper modules next to
it can be imported.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


__all__ = ["REWARD_TYPES", "RewardFunction", "RewardLoadError", "load_reward_function", "parse_reward_spec"]

logger = logging.getLogger(__name__)

REWARD_TYPES: tuple[str, ...] = ("batch", "sequential")
"""``batch``: called with a list of inputs, returns a list of outputs. ``sequential``: one input, one output."""

DEFAULT_FUNCTION = "main"

_module_counter = itertools.count()

# Modules whose pip package has another name (the rest install under their own name).
_PIP_NAMES = {
    "PIL": "pillow",
    "cv2": "opencv-python",
    "sklearn": "scikit-learn",
    "yaml": "pyyaml",
    "math_verify": "math-verify",
}


class RewardLoadError(ValueError):
    """The reward function cannot be loaded; the message names the file and the function."""


@dataclass
class RewardFunction:
    """A loaded reward function.

    ``fn`` already has the configured kwargs bound. ``fn`` and ``kwargs`` are kept out of ``repr`` because kwargs
    may carry secrets (an ``api_key`` for a judge model).
    """

    name: str
    """``file.py:function``, for messages."""
    fn: Callable[..., Any] = field(repr=False)
    """The function with ``kwargs`` bound (``functools.partial``)."""
    reward_type: str
    """``batch`` or ``sequential``."""
    reward_name: str
    """The file's ``REWARD_NAME`` or the function's name."""
    is_async: bool
    """The function is ``async def`` (awaited inside the worker's event loop)."""
    path: str = ""
    """Absolute path of the file (workers re-import it from here)."""
    function_name: str = DEFAULT_FUNCTION
    """Name of the function inside the file."""
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    """The bound keyword arguments."""


def parse_reward_spec(spec: str) -> tuple[str, str]:
    """Split ``path/to/file.py:function`` into the path and the function name (default ``main``)."""
    spec = spec.strip()
    path, sep, fn_name = spec.rpartition(":")
    # No colon, or a colon that belongs to the path (e.g. "C:/x.py"): the whole thing is the path.
    if not sep or not fn_name or "/" in fn_name or "\\" in fn_name or not path:
        return spec, DEFAULT_FUNCTION
    return path, fn_name


def _import_file(path: str) -> ModuleType:
    stem = os.path.splitext(os.path.basename(path))[0]
    safe_stem = "".join(c if c.isalnum() else "_" for c in stem)
    module_name = f"easyrl_reward_{safe_stem}_{os.getpid()}_{next(_module_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"reward file {path} cannot be imported (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        # Appended, not prepended: a reward file named math.py must not shadow the standard library.
        sys.path.append(folder)
    # Registered before executing so dataclasses/pickle inside the file can look the module up.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        sys.modules.pop(module_name, None)
        missing = (exc.name or str(exc)).split(".")[0]
        raise RewardLoadError(
            f"reward file {path} imports {missing!r}, which is not installed: pip install {_PIP_NAMES.get(missing, missing)}"
        ) from None
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RewardLoadError(f"reward file {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _defined_functions(module: ModuleType) -> list[str]:
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(value) and value.__module__ == module.__name__
    )


def _is_async(fn: Any) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


def load_reward_function(
    spec: str, kwargs: dict[str, Any] | None = None, reward_type: str = "batch"
) -> RewardFunction:
    """Import the reward function named by ``spec`` and bind ``kwargs`` to it.

    Args:
        spec: ``path/to/file.py:function``; without ``:function`` the function ``main`` is used.
        kwargs: keyword arguments bound to every call (``worker.reward.reward_function_kwargs``).
        reward_type: ``batch`` or ``sequential``, used when the file has no ``REWARD_TYPE`` attribute.

    Raises:
        RewardLoadError: the file is missing or fails to import, the function is missing or not callable, or the
            reward type is unknown.
    """
    path, fn_name = parse_reward_spec(spec)
    path = os.path.abspath(os.path.expanduser(path))
    name = f"{os.path.basename(path)}:{fn_name}"
    if not os.path.isfile(path):
        raise RewardLoadError(f"reward file not found: {path} (from worker.reward.reward_function={spec!r})")
    module = _import_file(path)
    if not hasattr(module, fn_name):
        defined = _defined_functions(module)
        raise RewardLoadError(
            f"reward file {path} has no function {fn_name!r}; it defines: {', '.join(defined) or 'no functions'}"
        )
    target = getattr(module, fn_name)
    if not callable(target):
        raise RewardLoadError(f"{path}: {fn_name!r} is a {type(target).__name__}, not a function")
    resolved_type = getattr(module, "REWARD_TYPE", None) or reward_type
    if resolved_type not in REWARD_TYPES:
        raise RewardLoadError(f"{path}: reward type {resolved_type!r} is not one of {REWARD_TYPES}")
    bound_kwargs = dict(kwargs or {})
    return RewardFunction(
        name=name,
        fn=functools.partial(target, **bound_kwargs),
        reward_type=resolved_type,
        reward_name=str(getattr(module, "REWARD_NAME", None) or getattr(target, "__name__", fn_name)),
        is_async=_is_async(target),
        path=path,
        function_name=fn_name,
        kwargs=bound_kwargs,
    )
