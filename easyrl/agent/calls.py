"""Tool calls: parsed from a completion's text, run with a deadline, answered with an observation.

Nothing the model writes can stop the run: a call that is not valid JSON, names no known tool, passes arguments the
function does not take, raises, or runs past `tool_timeout_s` gets an observation starting with `Error:` saying so,
and the trajectory goes on (the model can read it and try again).

Parsing follows the Hermes format that Qwen2.5 and Qwen3 were trained on:
`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`, any number per turn, text around them
allowed. Arguments given as a JSON string (some models write them so) are decoded too.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from easyrl.agent.env import Episode


__all__ = ["Observation", "ToolCall", "has_tool_call", "parse_tool_calls", "run_episode_calls", "run_tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


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

    def message(self) -> dict[str, Any]:
        """The conversation message of this observation (role `tool`, as chat templates expect)."""
        return {"role": "tool", "name": self.name, "content": self.content}


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


def _parse_block(block: str) -> ToolCall:
    try:
        call = json.loads(block.strip())
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(call["name"], error="the arguments are a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error="the arguments must be a JSON object of name: value")
    return ToolCall(call["name"], arguments)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"


def _call(fn: Any, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool, bool]:
    """Run one tool on a thread of its own; returns (text, is error, timed out). A thread past the deadline is
    left running (Python cannot stop it) as a daemon: user tools that may hang should bound themselves, and model
    code belongs in the `python` tool, whose sandbox kills it."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(**arguments)
        except BaseException as exc:  # SystemExit too: a tool never ends the run
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="easyrl-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"Error: the tool did not finish within {timeout_s:g}s", True, True
    if "error" in result:
        exc = result["error"]
        return f"Error: {type(exc).__name__}: {exc}", True, False
    return _as_text(result.get("value")), False, False


def run_episode_calls(episode: Episode, calls: list[ToolCall], timeout_s: float, max_chars: int) -> list[Observation]:
    """One trajectory's calls, in order (a call may read what the one before it changed)."""
    out = []
    for call in calls:
        start = time.perf_counter()
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
        text, error, timed_out = _call(fn, call.arguments, timeout_s)
        out.append(Observation(call.name, _cut(text, max_chars), error, time.perf_counter() - start, timed_out))
    return out


def run_tool_calls(
    jobs: list[tuple[Episode, list[ToolCall]]], timeout_s: float, max_chars: int, parallel: int
) -> list[list[Observation]]:
    """Every trajectory's calls of one turn, `parallel` trajectories at a time; observations in job order."""
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(parallel, len(jobs)), thread_name_prefix="easyrl-tools") as pool:
        # each job is bounded by its calls' deadlines, so waiting for the pool never hangs
        futures = [pool.submit(run_episode_calls, ep, calls, timeout_s, max_chars) for ep, calls in jobs]
        return [f.result() for f in futures]
