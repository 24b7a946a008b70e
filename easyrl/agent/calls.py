"""Tool calls: parsed from a completion's text, checked against the tool's schema, run with a deadline, answered
with an observation.

Nothing the model writes can stop the run: a call that is not valid JSON (nested past Python's recursion limit, or a
number of more digits than Python converts, too), names no known tool, passes arguments the function does not take or
of another type than its schema's, raises, exits, forks, or runs past `tool_timeout_s` gets an observation starting
with `Error:` saying so, and the trajectory goes on (the model can read it and try again). A result that cannot be
shown as text (a number past Python's digit limit, a structure nested too deep) is an error too, and lone surrogates
in a result are replaced: the tokenizer could not encode them.

Each call runs under the episode's `CallGuard` (`easyrl.agent.guard`): `os._exit` and `os.fork` are refused, and a
tool that timed out in a trajectory is not called again in it (each later call is answered at once), so k calls of a
hung tool cost one deadline, and across trajectories at most `max_parallel_tools` of its threads stay hung.

Parsing follows the Hermes format that Qwen2.5 and Qwen3 were trained on:
`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`, any number per turn, text around them
allowed. Arguments given as a JSON string (some models write them so) are decoded too.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from easyrl.agent.env import Episode
from easyrl.agent.guard import clean_text


__all__ = [
    "Observation",
    "ToolCall",
    "argument_error",
    "has_tool_call",
    "parse_tool_calls",
    "run_episode_calls",
    "run_tool_calls",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_ARGUMENT_CHARS = 1 << 20
"""The most characters one argument may hold (its strings' lengths and one per item): more is no tool's input."""
MAX_ARGUMENT_DEPTH = 64
"""The deepest nesting of lists and objects an argument may have."""
_JSON_KINDS: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, or (`error` set) what was wrong with a `<tool_call>` block."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Observation:
    """What the model reads back for one call."""

    name: str
    content: str
    error: bool
    seconds: float
    timed_out: bool = False
    failed: bool = False
    """The tool itself failed (timed out, tried to end or fork the process): counted against
    `max_env_error_ratio`, unlike the model's own mistakes (bad JSON, an unknown tool, a wrong argument)."""

    def message(self) -> dict[str, Any]:
        """The conversation message of this observation (role `tool`, as chat templates expect)."""
        # a name the model wrote may hold a lone surrogate (JSON "\\ud800"), which no tokenizer encodes
        return {"role": "tool", "name": clean_text(self.name), "content": clean_text(self.content)}


def has_tool_call(text: str) -> bool:
    """Whether the completion tried to call a tool at all (a malformed try included): the trajectory goes on."""
    return OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a completion in order; a malformed block becomes a `ToolCall` with its `error`."""
    calls = [_parse_block(block) for block in _BLOCK.findall(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text
    if OPEN in tail:  # opened after the last close (or never closed): the completion stopped inside a call
        calls.append(ToolCall(error=f"a {OPEN} without its {CLOSE}: write {OPEN}{{...}}{CLOSE}"))
    return calls


def _load_json(text: str) -> tuple[Any, str | None]:
    """`json.loads(text)`, or why it failed: besides malformed JSON, nesting deeper than Python's recursion limit
    raises RecursionError, and an integer of more digits than Python converts raises ValueError."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at position {exc.pos})"
    except RecursionError:
        return None, "not valid JSON here (nested too deeply)"
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return None, f"not valid JSON here ({str(exc).split(';')[0]})"


def _parse_block(block: str) -> ToolCall:
    call, error = _load_json(block.strip())
    if error is not None:
        return ToolCall(error=f"the tool call is {error}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string
        arguments, error = _load_json(arguments) if arguments.strip() else ({}, None)
        if error is not None:
            return ToolCall(call["name"], error=f"the arguments are a string that is not a JSON object: it is {error}")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error="the arguments must be a JSON object of name: value")
    return ToolCall(call["name"], arguments)


def _as_text(value: Any, limit: int) -> str:
    """The text the model reads for a tool's return value, cut to `limit` characters, lone surrogates replaced."""
    if isinstance(value, str):
        text = value
    elif value is None:
        text = ""
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):  # not JSON: a set, an object, an int past the digit limit
            try:
                text = str(value)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"the tool returned a {type(value).__name__} that cannot be shown as text") from exc
    return clean_text(_cut(text, limit))


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value, for messages."""
    if isinstance(value, bool):
        return "boolean"
    return next((k for k, types in _JSON_KINDS.items() if k != "number" and isinstance(value, types)), "number")


def _matches(value: Any, kind: str) -> bool:
    if isinstance(value, bool):  # JSON true is no integer, though Python's bool is an int
        return kind == "boolean"
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf: no tool takes it
        return False
    return isinstance(value, _JSON_KINDS.get(kind, object))


def _type_error(value: Any, spec: dict[str, Any]) -> str | None:
    """Why `value` is not of the schema `spec`'s type (and, for an array, its items'), or None."""
    kinds = spec.get("type")
    if kinds is None:  # `Any`: whatever the model passes
        return None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    kinds += ["null"] if spec.get("nullable") else []
    if not any(_matches(value, kind) for kind in kinds):
        shown = "a non-finite number" if isinstance(value, float) and not math.isfinite(value) else _kind(value)
        return f"is {shown}; the tool takes {' or '.join(kinds)}"
    items = spec.get("items")
    if isinstance(value, list) and isinstance(items, dict):
        for i, item in enumerate(value):
            error = _type_error(item, items)
            if error is not None:
                return f"item {i} {error}"
    return None


def _size_error(value: Any) -> str | None:
    """Whether `value` is past `MAX_ARGUMENT_CHARS` or `MAX_ARGUMENT_DEPTH` (walked without recursion: the value
    may be nested as deep as the JSON parser allowed)."""
    size, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            return f"is nested deeper than {MAX_ARGUMENT_DEPTH} levels"
        size += len(item) if isinstance(item, str) else 1
        if isinstance(item, dict):
            size += sum(len(str(k)) for k in item)
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
        if size > MAX_ARGUMENT_CHARS:
            return f"holds more than {MAX_ARGUMENT_CHARS} characters"
    return None


def argument_error(name: str, arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """The first argument of a call of tool `name` that its schema (`{"function": {"parameters": ...}}`) refuses,
    named with what is wrong; None when every argument fits."""
    properties = schema.get("function", {}).get("parameters", {}).get("properties", {})
    for key, value in arguments.items():
        error = _size_error(value) or (_type_error(value, properties[key]) if key in properties else None)
        if error is not None:
            return f"argument {key!r} of {name} {error}"
    return None


def run_episode_calls(episode: Episode, calls: list[ToolCall], timeout_s: float, max_chars: int) -> list[Observation]:
    """One trajectory's calls, in order (a call may read what the one before it changed)."""
    schemas = {s["function"]["name"]: s for s in episode.schemas}
    out = []
    for call in calls:
        if call.error is not None:
            out.append(Observation(call.name or "error", f"Error: {call.error}", True, 0.0))
            continue
        fn = episode.tools.get(call.name)
        if fn is None:
            known = ", ".join(sorted(episode.tools)) or "none"
            out.append(
                Observation(call.name, f"Error: no tool named {call.name!r}; the tools are: {known}", True, 0.0)
            )
            continue
        assert call.arguments is not None
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as exc:  # checked first, so a TypeError inside the tool is not taken for bad arguments
            out.append(Observation(call.name, f"Error: bad arguments for {call.name}: {exc}", True, 0.0))
            continue
        wrong = argument_error(call.name, call.arguments, schemas.get(call.name, {}))
        if wrong is not None:
            out.append(Observation(call.name, f"Error: bad arguments for {call.name}: {wrong}", True, 0.0))
            continue
        out.append(_run_one(episode, call.name, fn, call.arguments, timeout_s, max_chars))
    return out


def _run_one(
    episode: Episode, name: str, fn: Any, arguments: dict[str, Any], timeout_s: float, max_chars: int
) -> Observation:
    if name in episode.hung_tools:  # timed out earlier in this trajectory: one deadline per trajectory, not per call
        return Observation(name, f"Error: the tool {name} did not finish an earlier call; not called again", True, 0.0)
    start = time.perf_counter()
    outcome = episode.guard.call(
        f"tool {name}", lambda **kw: _as_text(fn(**kw), max_chars), arguments, timeout_s + PYTHON_TOOL_GRACE_S
    )
    seconds = time.perf_counter() - start
    if outcome.timed_out:
        episode.hung_tools.add(name)
        # the deadline shown is the configured one: the grace is the python tool's sandbox's time to report
        text = f"Error: the tool {name} did not finish within {timeout_s:g}s"
        return Observation(name, text, True, seconds, timed_out=True, failed=True)
    if outcome.refused:
        return Observation(name, f"Error: the tool {name} was not called: {outcome.error}", True, seconds, failed=True)
    if outcome.error is not None:
        text = f"Error: the tool {name} {outcome.error}" if outcome.fatal else f"Error: {outcome.error}"
        return Observation(name, text, True, seconds, failed=outcome.fatal)
    return Observation(name, outcome.value, False, seconds)


PYTHON_TOOL_GRACE_S = 1.0
"""Added to a tool call's deadline: the built-in `python` tool's sandbox stops its program at `tool_timeout_s` and
must still report that, as its own error, before the guard takes the call for hung."""


def run_tool_calls(
    jobs: list[tuple[Episode, list[ToolCall]]], timeout_s: float, max_chars: int, parallel: int
) -> list[list[Observation]]:
    """Every trajectory's calls of one turn, `parallel` trajectories at a time; observations in job order."""
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(parallel, len(jobs)), thread_name_prefix="easyrl-tools") as pool:
        # each job is bounded by its calls' deadlines (the guard's threads are daemons), so this never hangs
        futures = [pool.submit(run_episode_calls, ep, calls, timeout_s, max_chars) for ep, calls in jobs]
        return [f.result() for f in futures]
