"""Agentic rollouts' user side: environments and tools loaded from files, tool calls parsed and run.

The rollout loop that drives them, token in and token out, is `easyrl.rollout.multi_turn`; this package knows
nothing of engines, tokens or the trainer (docs/agentic.md).
"""

from easyrl.agent.calls import Observation, ToolCall, has_tool_call, parse_tool_calls, run_tool_calls
from easyrl.agent.env import AgentRunError, Environments, EnvType, Episode, load_environments, unknown_env_row
from easyrl.agent.tools import AgentLoadError, Tool, python_tool, tool_from_function


__all__ = [
    "AgentLoadError",
    "AgentRunError",
    "EnvType",
    "Environments",
    "Episode",
    "Observation",
    "Tool",
    "ToolCall",
    "has_tool_call",
    "load_environments",
    "parse_tool_calls",
    "python_tool",
    "run_tool_calls",
    "tool_from_function",
    "unknown_env_row",
]
