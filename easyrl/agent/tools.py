"""Tools: plain Python functions (or an environment's methods) the model calls by name.

A tool's JSON schema is made from its type hints and its docstring's `Args:` section by transformers'
`get_json_schema`, the schema `apply_chat_template(..., tools=...)` puts into the prompt, so the model is told about
a tool through its own chat template. A function without a hint or a documented argument is refused when the run
starts, naming the function and what to add.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from easyrl.sandbox import SandboxLimits, run_code


__all__ = ["AgentLoadError", "Tool", "import_file", "load_tool_file", "python_tool", "tool_from_function"]

_module_counter = itertools.count()


class AgentLoadError(ValueError):
    """An environment or tool file cannot be used; the message names the file, the class or function, and the fix."""


@dataclass(frozen=True)
class Tool:
    """One callable tool."""

    name: str
    schema: dict[str, Any]
    """`{"type": "function", "function": {"name", "description", "parameters"}}`, for the chat template."""
    fn: Callable[..., Any]


def tool_from_function(fn: Callable[..., Any], where: str) -> Tool:
    """The tool of a function or bound method (`where` names its file or class in errors)."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own parsing exceptions (type hints, docstring)
        raise AgentLoadError(
            f"tool {name} in {where}: {exc}; a tool needs a type hint on every argument and a docstring with a "
            "description and an `Args:` line per argument (transformers' get_json_schema)"
        ) from None
    schema["function"].pop("return", None)  # templates show what the model passes, not what comes back
    return Tool(name, schema, fn)


def import_file(path: str, what: str) -> ModuleType:
    """Import the Python file at `path` under a unique module name (`what` names it in errors: "environment file").

    Its folder is appended to `sys.path` (not prepended: a file named `math.py` must not shadow the standard
    library), so it can import helpers beside it."""
    if not os.path.isfile(path):
        raise AgentLoadError(f"{what} not found: {path}")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    name = f"easyrl_agent_{stem}_{os.getpid()}_{next(_module_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AgentLoadError(f"{what} {path} cannot be imported (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.append(folder)
    sys.modules[name] = module  # before executing: dataclasses and pickle inside the file look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise AgentLoadError(f"{what} {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def load_tool_file(path: str) -> list[Tool]:
    """Every public function defined in the file at `path` (imported ones are not tools)."""
    module = import_file(path, "tool file")
    functions = [
        value
        for key, value in vars(module).items()
        if not key.startswith("_") and inspect.isfunction(value) and value.__module__ == module.__name__
    ]
    if not functions:
        raise AgentLoadError(f"tool file {path} defines no public function: each public function is a tool")
    return [tool_from_function(fn, path) for fn in functions]


def python_tool(timeout_s: float, max_output_chars: int) -> Tool:
    """The built-in `python` tool: runs the model's code in `easyrl.sandbox` (no network, a scratch dir, limits)
    and returns what it printed, with the error's last lines when it failed."""
    limits = SandboxLimits(timeout_s=timeout_s, max_output_bytes=max(4 * max_output_chars, 4096))

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints (stdout, then the error if it failed).

        Args:
            code: the program; print the values you want to see.
        """
        result = run_code(code, limits=limits)
        out = result.stdout
        if result.status == "ok":
            return out or "(no output: print the values you want to see)"
        if result.status == "timeout":
            return f"{out}\nError: timed out after {timeout_s:g}s"
        if result.status == "error":
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            return f"{out}\n{tail}".strip()
        return f"{out}\nError: {result.status}".strip()

    return tool_from_function(python, "the built-in tools")
