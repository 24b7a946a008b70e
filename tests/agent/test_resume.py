"""An environment rebuilt for a resumed trajectory (`easyrl.agent.resume`): `state_dict` / `load_state_dict` are not
tools and come as a pair; a replay re-runs the environment's own calls only, and one that had timed out, or that
answers otherwise, is reported with the call it failed on."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.agent import AgentLoadError, Environments, ToolCall, load_environments
from easyrl.agent.calls import run_episode_calls
from easyrl.agent.resume import call_record, environment_state, rebuild_episode
from easyrl.config.multi_turn import MultiTurnConfig


REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "tests" / "assets" / "calc_resume_envs.py"
SHARED = '''
calls = []


def note(text: str) -> str:
    """Note something down.

    Args:
        text: what to note
    """
    calls.append(text)
    return "noted"
'''


def _start(env: str, tools: str | None = None) -> Environments:
    return load_environments(MultiTurnConfig(env=f"{ENVS}:{env}", tools=tools), lambda row: [])


def test_state_methods_are_not_tools_and_must_come_as_a_pair(tmp_path: Path) -> None:
    environments = _start("SavedCalcEnv")
    episode = environments.start({"prompt": "2*3"})
    assert sorted(episode.tools) == ["mul"]  # state_dict / load_state_dict stay out of the model's schemas
    half = tmp_path / "half.py"
    half.write_text(
        "class Half:\n    def reset(self, **row):\n        return 'hi'\n\n    def state_dict(self):\n        return {}\n"
    )
    with pytest.raises(AgentLoadError, match=r"half.py:Half defines one of state_dict / load_state_dict: define both"):
        load_environments(MultiTurnConfig(env=f"{half}:Half"), lambda row: [])


def test_a_replay_reruns_the_environments_calls_and_reports_one_that_differs_or_had_timed_out(tmp_path: Path) -> None:
    shared = tmp_path / "shared.py"
    shared.write_text(SHARED)
    environments = _start("DriftingCalcEnv", tools=str(shared))
    first = environments.start({"prompt": "2*3"})
    calls = [ToolCall("mul", {"a": 2, "b": 3}), ToolCall("note", {"text": "x"}), ToolCall(error="not JSON")]
    ran = [call_record(c, o) for c, o in zip(calls, run_episode_calls(first, calls, 5.0, 200), strict=True)]
    assert environment_state(first) is None  # no state_dict: the replay is the way back
    note = first.tools["note"]
    noted = len(note.__globals__["calls"])
    episode, reason = rebuild_episode(environments, {"prompt": "2*3"}, None, ran, 5.0, 200)
    assert reason == "call 1 (mul) returned '6 (session 2)', recorded '6 (session 1)'"
    assert episode.instance is not first.instance
    assert len(note.__globals__["calls"]) == noted  # a shared tool is never run again
    timed_out = [{**ran[0], "timed_out": True}]
    _, reason = rebuild_episode(environments, {"prompt": "2*3"}, None, timed_out, 5.0, 200)
    assert reason is not None and "had timed out" in reason


def test_a_saved_state_is_loaded_on_a_fresh_reset_instance(tmp_path: Path) -> None:
    environments = _start("SavedCalcEnv")
    first = environments.start({"prompt": "2*3"})
    run_episode_calls(first, [ToolCall("mul", {"a": 2, "b": 3})] * 2, 5.0, 200)
    saved = environment_state(first)
    assert saved == {"state": {"made": 2}}
    episode, reason = rebuild_episode(environments, {"prompt": "2*3"}, saved, [], 5.0, 200)
    assert reason is None and episode.instance.made == 2 and type(episode.instance).loads == 1
