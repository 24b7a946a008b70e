"""An environment rebuilt for a tool trajectory resumed from a checkpoint (carry-over keeps trajectories in flight
across steps, `trainer.max_staleness >= 1`; docs/agentic.md, "Resuming a run").

The trajectory's tokens and conversation are in its record; its environment is a user's object, rebuilt one of two
ways:

- **by its own state**: an environment that defines `state_dict()` (a JSON-able value) and `load_state_dict(state)`
  is saved beside the record; on resume a fresh instance is `reset` with the same row, then given the saved state;
- **by replay**: otherwise a fresh instance is `reset` with the same row and the tool calls the trajectory made of
  its methods run again, in order; each observation must equal the one recorded. Equal: the environment is where the
  trajectory left it. Different (a tool that is not deterministic), or a call that had timed out (its thread may have
  gone on changing the environment after the deadline): it cannot be rebuilt, and the loop starts that trajectory
  again from its prompt.

Calls of tools that are not the environment's methods (a tools file, the built-in `python`) are not run again: they
hold no state of the trajectory's, and running them may cost (a sandbox) or act twice.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from easyrl.agent.calls import Observation, ToolCall, run_episode_calls
from easyrl.agent.env import Environments, Episode


__all__ = ["call_record", "describe", "environment_state", "rebuild_episode"]


def call_record(call: ToolCall, observation: Observation) -> dict[str, Any]:
    """One call a trajectory ran and what it returned, as a checkpoint keeps it for the replay."""
    return {
        "name": call.name,
        "arguments": call.arguments,
        "error": call.error,
        "content": observation.content,
        "is_error": observation.error,
        "timed_out": observation.timed_out,
    }


def environment_state(episode: Episode) -> Any:
    """`{"state": <the environment's state_dict()>}`, checked JSON-able, or None when it has no `state_dict`."""
    instance = episode.instance
    if instance is None or not callable(getattr(instance, "state_dict", None)):
        return None
    where = f"environment {describe(episode)}"
    try:
        state = instance.state_dict()
    except Exception as exc:
        raise RuntimeError(f"{where}: state_dict() raised {type(exc).__name__}: {exc}; fix it (or remove it)") from exc
    try:  # a copy: the instance goes on changing after the snapshot; and what the checkpoint's JSON can hold
        return {"state": json.loads(json.dumps(state))}
    except (TypeError, ValueError) as exc:
        raise RuntimeError(
            f"{where}: state_dict() returned a value JSON cannot hold ({exc}): return dicts, lists, strings, numbers"
        ) from None


def rebuild_episode(
    environments: Environments,
    row: dict[str, Any],
    env_state: Any,
    ran: list[dict[str, Any]],
    timeout_s: float,
    max_chars: int,
) -> tuple[Episode, str | None]:
    """A fresh episode for `row` brought to where the trajectory left its environment: `env_state` loaded (from
    `environment_state`), or else the calls of `ran` (`call_record`s) to the environment's methods replayed. Returns
    the episode and None, or why it cannot be rebuilt (the first replayed observation that differs)."""
    episode = environments.start(row)
    instance = episode.instance
    if instance is None:  # no environment object: the shared tools hold no state of this trajectory's
        return episode, None
    if env_state is not None and callable(getattr(instance, "load_state_dict", None)):
        try:
            instance.load_state_dict(env_state["state"])
        except Exception as exc:  # user code: the run stops naming it, rather than go on from a half-loaded state
            raise RuntimeError(
                f"environment {describe(episode)}: load_state_dict(state) raised {type(exc).__name__}: {exc}; fix it"
            ) from exc
        return episode, None
    own = {name for name, fn in episode.tools.items() if getattr(fn, "__self__", None) is instance}
    for k, record in enumerate(ran):
        if record["error"] is not None or record["name"] not in own:
            continue  # a malformed call touched nothing; another tool holds no state of the environment's
        if record["timed_out"]:
            return episode, f"call {k + 1} ({record['name']}) had timed out: what it did after its deadline is unknown"
        (again,) = run_episode_calls(episode, [ToolCall(record["name"], record["arguments"])], timeout_s, max_chars)
        if (again.content, again.error, again.timed_out) != (record["content"], record["is_error"], False):
            return episode, (
                f"call {k + 1} ({record['name']}) returned {again.content[:60]!r}, recorded {record['content'][:60]!r}"
            )
    return episode, None


def describe(episode: Episode) -> str:
    """The environment's name in the config and its class as the config names it (`file.py:Class`), for messages."""
    instance = episode.instance
    if instance is None:
        return episode.env_name
    cls = type(instance)
    # environment files are imported under generated module names (`tools.import_file`): show the file instead
    where = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
    return f"{episode.env_name} ({where}:{cls.__qualname__})"
