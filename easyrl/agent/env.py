"""Environments: a class loaded from `path/to/file.py:Class`, one instance per trajectory.

The contract (docs/agentic.md):

- `reset(**row)` gets the dataset row's columns and returns the prompt: a text (one user message) or a list of
  `{"role", "content"}` messages;
- every other public method is a tool (schema from its type hints and docstring, `easyrl.agent.tools`);
- `get_reward()`, optional, is read once the trajectory ends and handed to the reward function as `env_reward`;
- an attribute `done` set to true by a tool ends the trajectory after that turn's calls;
- `state_dict()` / `load_state_dict(state)`, optional (both or neither), save and restore its state when a run
  resumes with trajectories in flight (`easyrl.agent.resume`; without them the tool calls are replayed).

Every call into the environment (the constructor and `reset`, `done` when it is a property, `get_reward`) runs under
the run's `CallGuard` with the deadline `env_timeout_s`, as tools do under theirs. A row whose environment fails to
open (its `env` column names none of `envs`, the class needs arguments, `reset` raises, hangs or returns no prompt) or
whose `done` fails gets an `Episode` with `error` set instead of an exception: the loop drops that trajectory (trains
none of it) and counts it; the run stops only past `max_env_error_ratio` of a step's trajectories.

Without an environment (`tools` only) each trajectory's prompt is the dataset's own (the prompt template's), and the
tools are the same functions for every trajectory.
"""

from __future__ import annotations

import inspect
import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from easyrl.agent.guard import CallGuard, Outcome, clean_text
from easyrl.agent.tools import AgentLoadError, Tool, import_file, load_tool_file, python_tool, tool_from_function
from easyrl.config.multi_turn import MultiTurnConfig


__all__ = ["AgentRunError", "EnvType", "Environments", "Episode", "load_environments", "unknown_env_row"]

logger = logging.getLogger(__name__)

RESERVED = ("reset", "get_reward", "state_dict", "load_state_dict")
"""Public methods of an environment that are not tools."""
Messages = list[dict[str, Any]]
_default_guard: CallGuard | None = None


class AgentRunError(RuntimeError):
    """More than `max_env_error_ratio` of a step's trajectories failed in their environment or tools; the message
    names the first failure (the environment or tool, and its error)."""


def default_guard() -> CallGuard:
    """The guard of episodes made without one (tests, scripts): one per process, so hung calls are counted across
    them as a run's are."""
    global _default_guard
    if _default_guard is None:
        _default_guard = CallGuard(max_hung=16)
    return _default_guard


class _Probe:
    """What an unbound method is bound to for its schema: `get_json_schema` must not see `self`."""


@dataclass
class Episode:
    """One trajectory's environment: its instance (None without an environment class), its tools by name, and the
    conversation `reset` opened; `error` set: the environment failed (the trajectory is dropped)."""

    env_name: str
    instance: Any
    tools: dict[str, Callable[..., Any]]
    schemas: list[dict[str, Any]]
    messages: Messages
    guard: CallGuard = field(default_factory=default_guard, repr=False)
    env_timeout_s: float = 60.0
    error: str | None = None
    """Why the environment failed for this row (it did not open, or `done` failed): the trajectory is dropped."""
    reward_error: str | None = field(default=None, init=False)
    tool_failure: str | None = field(default=None, init=False)
    """The first call of a tool that failed on the tool's side (timed out, tried to exit or fork)."""
    hung_tools: set[str] = field(default_factory=set, init=False)
    """Tools that did not finish a call within the deadline: not called again in this trajectory."""

    @property
    def owner(self) -> str:
        return f"environment {self.env_name}"

    @property
    def done(self) -> bool:
        """Whether the episode is over: a tool set the environment's `done`, or the environment failed (`error`).
        A plain attribute is read at once; a property (user code) under the guard."""
        if self.error is not None:
            return True
        if self.instance is None:
            return False
        cls = type(self.instance)
        static = inspect.getattr_static(self.instance, "done", False)
        # a plain attribute is read without a thread; a descriptor or a custom attribute lookup is user code
        plain = not hasattr(static, "__get__") and not hasattr(cls, "__getattr__")
        if plain and cls.__getattribute__ is object.__getattribute__:
            return static is True
        outcome = self.guard.call(
            self.owner, lambda: getattr(self.instance, "done", False) is True, {}, self.env_timeout_s
        )
        if outcome.error is not None:
            self.error = f"{self.owner}: reading done failed: {outcome.error}"
            return True
        return bool(outcome.value)

    def reward(self) -> float | None:
        """The environment's `get_reward()`, or None without one (or when it raised or passed the deadline:
        `reward_error` says why, and the reward function then sees no `env_reward`)."""
        instance = self.instance
        own = getattr(instance, "__dict__", {})  # a get_reward set on the instance counts too
        if instance is None or (getattr(type(instance), "get_reward", None) is None and "get_reward" not in own):
            return None
        # the lookup is inside the guarded call too: a `__getattr__` is user code
        outcome = self.guard.call(self.owner, lambda: float(instance.get_reward()), {}, self.env_timeout_s)
        if outcome.error is None and not math.isfinite(outcome.value):
            outcome = Outcome(error=f"returned {outcome.value}: return a finite number")
        if outcome.error is not None:  # user code: counted by the loop, never a crash mid-step
            self.reward_error = outcome.error
            return None
        return float(outcome.value)


@dataclass
class EnvType:
    """One environment class (or the dataset's own prompt) and the tools its episodes get."""

    name: str
    cls: type | None
    methods: tuple[str, ...]
    """The class's tool methods, bound to each episode's instance."""
    shared: tuple[Tool, ...]
    """Tools from files and the built-ins: the same functions for every episode."""
    schemas: list[dict[str, Any]]
    dataset_prompt: Callable[[dict[str, Any]], Messages]

    def start(self, row: dict[str, Any], guard: CallGuard, timeout_s: float) -> Episode:
        """A fresh episode for `row`: a new instance, reset with the row's columns (both under `guard`, within
        `timeout_s`); `error` set when that failed."""
        tools = {tool.name: tool.fn for tool in self.shared}
        if self.cls is None:
            return Episode(self.name, None, tools, self.schemas, self.dataset_prompt(row), guard, timeout_s)
        cls, where = self.cls, self.cls.__qualname__  # the module is a generated name: the class says more

        def open_episode() -> tuple[Any, Messages | str]:
            """The instance and its prompt, or why there is none (the constructor or `reset` named)."""
            stage = f"{where}()"
            try:
                instance = cls()
                stage = f"{where}.reset(**row)"
                opened = instance.reset(**row)
                return instance, as_messages(opened, f"{where}.reset")
            except TypeError as exc:
                fix = "accept the columns with **row" if "reset" in stage else "build it with no arguments"
                return None, f"{stage} failed: TypeError: {exc}; {fix}"
            except AgentLoadError as exc:
                return None, str(exc)
            except Exception as exc:
                return None, f"{stage} raised {type(exc).__name__}: {exc}"

        outcome = guard.call(f"environment {self.name}", open_episode, {}, timeout_s)
        opened = outcome.value[1] if outcome.error is None else f"{where}() and reset(**row) {outcome.error}"
        if isinstance(opened, str):
            failed = Episode(self.name, None, {}, self.schemas, [], guard, timeout_s)
            failed.error = f"environment {self.name}: {opened}"
            return failed
        instance = outcome.value[0]
        tools |= {name: getattr(instance, name) for name in self.methods}
        return Episode(self.name, instance, tools, self.schemas, opened, guard, timeout_s)


def as_messages(opened: Any, where: str) -> Messages:
    """`reset`'s prompt as messages: a text is one user message."""
    # lone surrogates replaced: the tokenizer cannot encode them, and one row must not end the run
    if isinstance(opened, str):
        return [{"role": "user", "content": clean_text(opened)}]
    if isinstance(opened, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in opened):
        return [
            {**m, "content": clean_text(m["content"]) if isinstance(m["content"], str) else m["content"]}
            for m in opened
        ]
    raise AgentLoadError(f"{where} returned {type(opened).__name__}: return the prompt text or a list of messages")


def _env_methods(cls: type, where: str) -> tuple[tuple[str, ...], list[Tool]]:
    """The tool methods of `cls` (public, callable, not `reset` / `get_reward`) and their schemas."""
    if not callable(getattr(cls, "reset", None)):
        raise AgentLoadError(f"{where} has no reset(**row) method: it must return the prompt for a dataset row")
    pair = [callable(getattr(cls, name, None)) for name in ("state_dict", "load_state_dict")]
    if any(pair) and not all(pair):  # half a pair would save a state nothing restores, or restore none
        raise AgentLoadError(
            f"{where} defines one of state_dict / load_state_dict: define both (a resume restores "
            "its state) or neither (a resume replays its tool calls)"
        )
    names, tools = [], []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in RESERVED:
            continue
        static = inspect.getattr_static(cls, name)
        if isinstance(static, staticmethod | classmethod):
            tools.append(tool_from_function(getattr(cls, name), where))
        elif inspect.isfunction(static):
            tools.append(tool_from_function(types.MethodType(static, _Probe()), where))
        else:
            continue  # attributes and properties are state, not tools
        names.append(name)
    return tuple(names), tools


def load_env_class(spec: str) -> type:
    """The class named by `path/to/file.py:Class`."""
    path, _, name = spec.rpartition(":")
    module = import_file(path, "environment file")
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        defined = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise AgentLoadError(
            f"environment file {path} has no class {name!r}; it defines: {', '.join(defined) or 'none'}"
        )
    return cls


class Environments:
    """The run's environment types; a row's comes from its `key` column when there are several. Every call into
    them runs under `guard` within `timeout_s` (`worker.rollout.multi_turn.env_timeout_s`)."""

    def __init__(
        self, env_types: dict[str, EnvType], key: str | None, guard: CallGuard | None = None, timeout_s: float = 60.0
    ) -> None:
        self.types = env_types
        self.key = key
        self.guard = guard or default_guard()
        self.timeout_s = timeout_s

    def start(self, row: dict[str, Any]) -> Episode:
        """The row's episode; never raises for the row's sake: a failure is the episode's `error`."""
        if self.key is None:
            return next(iter(self.types.values())).start(row, self.guard, self.timeout_s)
        name = row.get(self.key)
        if name not in self.types:
            failed = Episode(str(name), None, {}, [], [], self.guard, self.timeout_s)
            failed.error = _unknown(self.key, name, self.types)
            return failed
        return self.types[str(name)].start(row, self.guard, self.timeout_s)


def _unknown(key: str, name: Any, known: Any) -> str:
    return (
        f"row column {key!r} (worker.rollout.multi_turn.env_key) is {name!r}; "
        f"worker.rollout.multi_turn.envs has: {', '.join(sorted(known))}"
    )


def unknown_env_row(mt: MultiTurnConfig, rows: Any) -> str | None:
    """One line naming the first of `rows` (`(where, row)` pairs) whose environment column names none of `envs`,
    and the known ones; None when every row names one (or the run has a single environment)."""
    if len(mt.env_specs()) < 2:
        return None
    for where, row in rows:
        if row.get(mt.env_key) not in mt.envs:
            return f"{where}: {_unknown(mt.env_key, row.get(mt.env_key), mt.envs)}"
    return None


def load_environments(mt: MultiTurnConfig, dataset_prompt: Callable[[dict[str, Any]], Messages]) -> Environments:
    """Import the environments and tools of the config; every schema is made now, so a tool without hints or
    docstring stops the run before anything starts."""
    shared: list[Tool] = []
    for entry in mt.tool_entries():
        if entry == "python":
            shared.append(python_tool(mt.tool_timeout_s, mt.max_tool_output_chars))
        else:
            shared += load_tool_file(entry)
    _check_unique([t.name for t in shared], "worker.rollout.multi_turn.tools")
    env_types: dict[str, EnvType] = {}
    specs: dict[str, str | None] = {**mt.env_specs()} or {"dataset": None}
    for name, spec in specs.items():
        if spec is None:
            env_types[name] = EnvType(name, None, (), tuple(shared), [t.schema for t in shared], dataset_prompt)
            continue
        cls = load_env_class(spec)
        methods, own = _env_methods(cls, spec)
        _check_unique([t.name for t in own + shared], f"{spec} with worker.rollout.multi_turn.tools")
        schemas = [t.schema for t in own + shared]
        env_types[name] = EnvType(name, cls, methods, tuple(shared), schemas, dataset_prompt)
        logger.info("environment %s: %s, tools %s", name, spec, [s["function"]["name"] for s in schemas])
    # one hung call per parallel slot at most, per environment or tool: past that their calls are refused at once
    guard = CallGuard(max_hung=mt.max_parallel_tools)
    return Environments(env_types, mt.env_key if len(env_types) > 1 else None, guard, mt.env_timeout_s)


def _check_unique(names: list[str], where: str) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise AgentLoadError(f"{where}: tool name(s) {sorted(seen)} defined twice; rename one")
