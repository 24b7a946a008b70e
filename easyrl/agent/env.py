"""Environments: a class loaded from `path/to/file.py:Class`, one instance per trajectory.

The contract (docs/agentic.md):

- `reset(**row)` gets the dataset row's columns and returns the prompt: a text (one user message) or a list of
  `{"role", "content"}` messages;
- every other public method is a tool (schema from its type hints and docstring, `easyrl.agent.tools`);
- `get_reward()`, optional, is read once the trajectory ends and handed to the reward function as `env_reward`;
- an attribute `done` set to true by a tool ends the trajectory after that turn's calls;
- `state_dict()` / `load_state_dict(state)`, optional (both or neither), save and restore its state when a run
  resumes with trajectories in flight (`easyrl.agent.resume`; without them the tool calls are replayed).

Without an environment (`tools` only) each trajectory's prompt is the dataset's own (the prompt template's), and the
tools are the same functions for every trajectory.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from easyrl.agent.tools import AgentLoadError, Tool, import_file, load_tool_file, python_tool, tool_from_function
from easyrl.config.multi_turn import MultiTurnConfig


__all__ = ["EnvType", "Environments", "Episode", "load_environments"]

logger = logging.getLogger(__name__)

RESERVED = ("reset", "get_reward", "state_dict", "load_state_dict")
"""Public methods of an environment that are not tools."""
Messages = list[dict[str, Any]]


class _Probe:
    """What an unbound method is bound to for its schema: `get_json_schema` must not see `self`."""


@dataclass
class Episode:
    """One trajectory's environment: its instance (None without an environment class), its tools by name, and the
    conversation `reset` opened."""

    env_name: str
    instance: Any
    tools: dict[str, Callable[..., Any]]
    schemas: list[dict[str, Any]]
    messages: Messages
    reward_error: str | None = field(default=None, init=False)

    @property
    def done(self) -> bool:
        """Whether a tool ended the episode (the environment's `done` attribute)."""
        return getattr(self.instance, "done", False) is True

    def reward(self) -> float | None:
        """The environment's `get_reward()`, or None without one (or when it raised: `reward_error` says why, and
        the reward function then sees no `env_reward`)."""
        get = getattr(self.instance, "get_reward", None)
        if get is None:
            return None
        try:
            return float(get())
        except Exception as exc:  # user code: counted by the loop, never a crash mid-step
            self.reward_error = f"{type(exc).__name__}: {exc}"
            return None


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

    def start(self, row: dict[str, Any]) -> Episode:
        """A fresh episode for `row`: a new instance, reset with the row's columns."""
        tools = {tool.name: tool.fn for tool in self.shared}
        if self.cls is None:
            return Episode(self.name, None, tools, self.schemas, self.dataset_prompt(row))
        instance = self.cls()
        where = f"{self.cls.__module__}.{self.cls.__name__}"
        try:
            opened = instance.reset(**row)
        except TypeError as exc:
            raise AgentLoadError(
                f"{self.name}: {where}.reset(**row) failed: {exc}; accept the columns with **row"
            ) from None
        tools |= {name: getattr(instance, name) for name in self.methods}
        return Episode(self.name, instance, tools, self.schemas, as_messages(opened, f"{where}.reset"))


def as_messages(opened: Any, where: str) -> Messages:
    """`reset`'s prompt as messages: a text is one user message."""
    if isinstance(opened, str):
        return [{"role": "user", "content": opened}]
    if isinstance(opened, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in opened):
        return [dict(m) for m in opened]
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
    """The run's environment types; a row's comes from its `key` column when there are several."""

    def __init__(self, env_types: dict[str, EnvType], key: str | None) -> None:
        self.types = env_types
        self.key = key

    def start(self, row: dict[str, Any]) -> Episode:
        if self.key is None:
            return next(iter(self.types.values())).start(row)
        name = row.get(self.key)
        if name not in self.types:
            raise AgentLoadError(
                f"row column {self.key!r} (worker.rollout.multi_turn.env_key) is {name!r}; "
                f"worker.rollout.multi_turn.envs has: {', '.join(sorted(self.types))}"
            )
        return self.types[str(name)].start(row)


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
    return Environments(env_types, mt.env_key if len(env_types) > 1 else None)


def _check_unique(names: list[str], where: str) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise AgentLoadError(f"{where}: tool name(s) {sorted(seen)} defined twice; rename one")
