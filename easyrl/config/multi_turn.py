"""Configuration of multi-turn rollouts with tools and environments (``worker.rollout.multi_turn.*``).

Set `env` (or `envs`) or `tools` to turn them on; the rollout loop is then `easyrl.rollout.multi_turn.MultiTurnLoop`
(docs/agentic.md).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

from easyrl.config.errors import ConfigError


BUILTIN_TOOLS = ("python",)
"""Tools `tools` may name instead of a file: `python` runs the model's code in `easyrl.sandbox`."""
TOOL_CALL_FORMATS = ("hermes",)
"""How calls are written: `hermes` is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3,
Hermes)."""
KEY = "worker.rollout.multi_turn"
MAX_TIMEOUT_S = 3600.0
"""The longest deadline a tool or environment call may have: a larger one is a run that may wait hours on one call."""


@dataclass
class MultiTurnConfig:
    env: str | None = None
    """`path/to/file.py:Class`: an environment class, one instance per trajectory. `reset(**row)` gets the dataset
    columns and returns the prompt (text or messages); every other public method is a tool; an optional
    `get_reward()` is handed to the reward function as `env_reward`."""
    envs: dict[str, str] = field(default_factory=dict)
    """Several environments, `{name: path/to/file.py:Class}`; the dataset column `env_key` names each row's. Instead
    of `env`."""
    env_key: str = "env"
    """The dataset column that picks a row's environment from `envs`."""
    tools: str | None = None
    """Comma-separated tool files (each public function with type hints and a docstring is a tool) and built-in
    tools (`python`). Without an environment the prompt is the dataset's, as in a single-turn run."""
    max_turns: int = 4
    """Most assistant turns per trajectory; a trajectory still calling tools at the last one ends truncated."""
    max_total_tokens: int | None = None
    """Token budget of a trajectory after its prompt (generated and tool tokens together); null:
    `data.max_response_length`, which it may not exceed. A trajectory that reaches it ends truncated."""
    max_tokens_per_turn: int | None = None
    """Most tokens generated in one turn; null: what is left of the budget."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call; a call past it gets an error observation (the `python` tool's sandbox
    kills its program at this limit)."""
    env_timeout_s: float = 60.0
    """Wall-clock limit of each call into an environment other than its tools: the constructor with `reset`, `done`
    when it is a property, `get_reward`. Past it the trajectory is dropped (reset, done) or gets no `env_reward`,
    and counted; the call's thread is left behind (Python cannot stop one)."""
    max_env_error_ratio: float = 0.5
    """The run stops, with one line naming the first failure, when more than this share of a step's trajectories
    failed in their environment (dropped) or in a tool (timed out, tried to end or fork the process)."""
    tool_call_format: str = "hermes"
    """How the model writes tool calls: hermes (`<tool_call>` JSON, Qwen2.5 / Qwen3 / Hermes)."""
    max_tool_output_chars: int = 4096
    """Longer tool output is cut to this many characters (noting the cut) before it is tokenized."""
    max_parallel_tools: int = 16
    """Trajectories whose tool calls run at once (on threads of the driver; one trajectory's calls run in order)."""

    @property
    def enabled(self) -> bool:
        """Whether the run rolls out several turns (an environment or a tool is set)."""
        return bool(self.env or self.envs or self.tools)

    def env_specs(self) -> dict[str, str]:
        """{name: `file.py:Class`} of every environment (`env` under the name `default`)."""
        return dict(self.envs) if self.envs else ({"default": self.env} if self.env else {})

    def tool_entries(self) -> list[str]:
        """The entries of `tools`: file paths and built-in names."""
        return [part.strip() for part in (self.tools or "").split(",") if part.strip()]

    def resolve_paths(self) -> None:
        """Make the files absolute (relative to the working directory, as the reward function's)."""

        def absolute(spec: str) -> str:
            file, sep, name = spec.rpartition(":")
            if not sep or not file.endswith(".py"):
                return spec
            return f"{os.path.abspath(file) if os.path.exists(file) else file}:{name}"

        if self.env:
            self.env = absolute(self.env)
        self.envs = {name: absolute(spec) for name, spec in self.envs.items()}
        if self.tools:
            entries = [os.path.abspath(e) if os.path.exists(e) else e for e in self.tool_entries()]
            self.tools = ",".join(entries)


def check_multi_turn(mt: MultiTurnConfig, max_response_length: int) -> None:
    """Raise `ConfigError` naming the key for the first problem of the multi-turn section."""
    if not mt.enabled:
        return
    if mt.env and mt.envs:
        raise ConfigError(f"{KEY}.envs", "is set together with env: give one environment (env) or several (envs)")
    for name, spec in mt.env_specs().items():
        key = f"{KEY}.env" if mt.env else f"{KEY}.envs.{name}"
        _check_class_spec(key, spec)
    for entry in mt.tool_entries():
        if entry in BUILTIN_TOOLS:
            continue
        if not entry.endswith(".py"):
            raise ConfigError(
                f"{KEY}.tools",
                f"{entry!r} is neither a .py file nor a built-in tool ({', '.join(BUILTIN_TOOLS)})",
            )
        if not Path(entry).is_file():
            raise ConfigError(
                f"{KEY}.tools", f"tool file not found: {entry} (paths are read from the working directory)"
            )
    if mt.tool_call_format not in TOOL_CALL_FORMATS:
        raise ConfigError(f"{KEY}.tool_call_format", f"{mt.tool_call_format!r}: choose one of {TOOL_CALL_FORMATS}")
    for name in ("max_turns", "max_tool_output_chars", "max_parallel_tools"):
        if getattr(mt, name) < 1:
            raise ConfigError(f"{KEY}.{name}", f"must be at least 1, got {getattr(mt, name)}")
    for name in ("tool_timeout_s", "env_timeout_s"):
        value = getattr(mt, name)
        if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
            raise ConfigError(f"{KEY}.{name}", f"must lie in (0, {MAX_TIMEOUT_S:g}] seconds, got {value}")
    if not 0 <= mt.max_env_error_ratio <= 1:
        raise ConfigError(f"{KEY}.max_env_error_ratio", f"must lie in [0, 1], got {mt.max_env_error_ratio}")
    budget = mt.max_total_tokens
    if budget is not None and not 1 <= budget <= max_response_length:
        raise ConfigError(
            f"{KEY}.max_total_tokens",
            f"{budget} must lie in [1, data.max_response_length={max_response_length}]: a trajectory's tokens after "
            "its prompt form one response row; raise data.max_response_length for longer trajectories",
        )
    if mt.max_tokens_per_turn is not None and mt.max_tokens_per_turn < 1:
        raise ConfigError(f"{KEY}.max_tokens_per_turn", f"must be at least 1 or null, got {mt.max_tokens_per_turn}")


def _check_class_spec(key: str, spec: str) -> None:
    """`file.py:Class` names an existing file that defines that class (read with `ast`: nothing is imported)."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py") or not name:
        raise ConfigError(key, f"expected path/to/file.py:Class, got {spec!r}")
    if not Path(file).is_file():
        raise ConfigError(key, f"environment file not found: {file} (paths are read from the working directory)")
    try:
        tree = ast.parse(Path(file).read_text(encoding="utf-8"), filename=file)
    except SyntaxError as exc:
        raise ConfigError(key, f"{file} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    classes = sorted(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    if name not in classes:
        raise ConfigError(key, f"no class {name!r} in {file}; it defines: {', '.join(classes) or 'no classes'}")
