"""Environments and tool files loaded from their paths, as `worker.rollout.multi_turn` names them: which methods are
tools, what `reset` may return, routing rows to several environments, and every mistake refused with its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from easyrl.agent import AgentLoadError, load_environments, unknown_env_row
from easyrl.config.multi_turn import MultiTurnConfig


REPO = Path(__file__).resolve().parents[2]

STATEFUL = '''
class Counter:
    """Counts up; the reward is the count."""

    limit = 3  # a class attribute: state, not a tool

    def reset(self, start: int, **row):
        self.count = start
        return [{"role": "system", "content": "count"}, {"role": "user", "content": f"from {start}"}]

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much
        """
        self.count += by
        self.done = self.count >= self.limit
        return self.count

    @staticmethod
    def echo(text: str) -> str:
        """Say it back.

        Args:
            text: what to say
        """
        return text

    @property
    def doubled(self) -> int:
        return 2 * self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _private(self) -> None:
        pass
'''


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _prompt(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}]


def test_public_methods_are_tools_and_reset_get_reward_private_and_properties_are_not(tmp_path: Path) -> None:
    spec = _write(tmp_path, "counter.py", STATEFUL) + ":Counter"
    envs = load_environments(MultiTurnConfig(env=spec), _prompt)
    episode = envs.start({"start": 1, "prompt": "unused"})
    assert sorted(episode.tools) == ["bump", "echo"]
    assert [s["function"]["name"] for s in episode.schemas] == ["bump", "echo"]
    assert episode.schemas[0]["function"]["parameters"]["properties"] == {
        "by": {"type": "integer", "description": "how much"}
    }
    assert episode.messages[1] == {"role": "user", "content": "from 1"}  # reset's messages as they are
    # one instance per trajectory: a second episode does not see the first one's state
    other = envs.start({"start": 10})
    assert episode.tools["bump"](by=1) == 2 and not episode.done
    assert episode.tools["bump"](by=1) == 3 and episode.done and episode.reward() == 3.0
    assert other.reward() == 10.0 and not other.done


def test_a_tools_file_without_an_environment_opens_with_the_dataset_prompt() -> None:
    mt = MultiTurnConfig(tools=f"{REPO / 'envs' / 'calc_tools.py'},python")
    episode = load_environments(mt, _prompt).start({"prompt": "2*3"})
    assert episode.messages == [{"role": "user", "content": "2*3"}]
    assert sorted(episode.tools) == ["add", "mul", "python"]
    assert episode.tools["mul"](a=6, b=7) == 42 and episode.reward() is None and episode.instance is None


def test_several_environments_are_routed_by_a_dataset_column(tmp_path: Path) -> None:
    counter = _write(tmp_path, "counter.py", STATEFUL) + ":Counter"
    calc = f"{REPO / 'envs' / 'calc.py'}:CalcEnv"
    envs = load_environments(MultiTurnConfig(envs={"count": counter, "calc": calc}, env_key="kind"), _prompt)
    assert envs.start({"kind": "calc", "prompt": "6*7"}).messages == [{"role": "user", "content": "6*7"}]
    assert "bump" in envs.start({"kind": "count", "start": 0}).tools
    # a row naming no environment fails alone (its trajectory is dropped and counted), never the run
    failed = envs.start({"kind": "nope"})
    assert failed.done and re.search(r"row column 'kind' .* is 'nope'; .*envs has: calc, count", failed.error or "")
    mt = MultiTurnConfig(envs={"count": counter, "calc": calc}, env_key="kind")
    rows = [("train.jsonl row 0", {"kind": "calc"}), ("train.jsonl row 1", {"kind": "nope"})]
    assert unknown_env_row(mt, rows) == (
        "train.jsonl row 1: row column 'kind' (worker.rollout.multi_turn.env_key) is 'nope'; "
        "worker.rollout.multi_turn.envs has: calc, count"
    )
    assert unknown_env_row(mt, rows[:1]) is None


@pytest.mark.parametrize(
    ("source", "spec_suffix", "message"),
    [
        ("class A:\n    pass\n", ":B", "has no class 'B'; it defines: A"),
        ("class A:\n    pass\n", ":A", "has no reset"),
        ("import not_a_module_anywhere\n", ":A", "failed to import: ModuleNotFoundError"),
        (
            "class A:\n    def reset(self, **row):\n        return 'hi'\n    def tool(self, x):\n        '''Doc.'''\n",
            ":A",
            "tool tool in .*: .*type hint",
        ),
    ],
)
def test_a_bad_environment_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, source: str, spec_suffix: str, message: str
) -> None:
    spec = _write(tmp_path, "bad_env.py", source) + spec_suffix
    with pytest.raises(AgentLoadError, match=message):
        load_environments(MultiTurnConfig(env=spec), _prompt)


def test_reset_must_return_text_or_messages_and_take_the_row(tmp_path: Path) -> None:
    """Each failure is that row's episode's `error` (the trajectory is dropped), naming the class and the fix."""
    source = "class A:\n    def reset(self, only: int):\n        return 3\n"
    envs = load_environments(MultiTurnConfig(env=_write(tmp_path, "a.py", source) + ":A"), _prompt)
    error = envs.start({"only": 1, "prompt": "x"}).error or ""
    assert re.search(r"^environment default: .*A\.reset\(\*\*row\) failed: .*accept the columns with \*\*row", error)
    error = envs.start({"only": 1}).error or ""
    assert "returned int: return the prompt text or a list of messages" in error


def test_a_constructor_needing_arguments_or_a_reset_that_raises_fails_its_row_alone(tmp_path: Path) -> None:
    source = (
        "class Needs:\n    def __init__(self, x):\n        pass\n    def reset(self, **row):\n        return 'p'\n"
        "class Raises:\n    def reset(self, **row):\n        if row['bad']:\n            raise KeyError('no')\n"
        "        return 'fine \\udc80'\n"
    )
    path = _write(tmp_path, "a.py", source)
    error = load_environments(MultiTurnConfig(env=path + ":Needs"), _prompt).start({}).error or ""
    assert "Needs() failed: TypeError:" in error and "build it with no arguments" in error
    envs = load_environments(MultiTurnConfig(env=path + ":Raises"), _prompt)
    assert "Raises.reset(**row) raised KeyError: 'no'" in (envs.start({"bad": True}).error or "")
    good = envs.start({"bad": False})  # a lone surrogate in the prompt is replaced: a tokenizer cannot encode it
    assert good.error is None and good.messages == [{"role": "user", "content": "fine \ufffd"}]


def test_two_tools_of_one_name_are_refused(tmp_path: Path) -> None:
    tools = _write(
        tmp_path,
        "t.py",
        "def mul(a: int, b: int) -> int:\n    '''M.\n\n    Args:\n        a: a\n        b: b\n    '''\n",
    )
    calc = f"{REPO / 'envs' / 'calc.py'}:CalcEnv"
    with pytest.raises(AgentLoadError, match=r"tool name\(s\) \['mul'\] defined twice"):
        load_environments(MultiTurnConfig(env=calc, tools=tools), _prompt)


def test_a_get_reward_that_raises_is_reported_not_raised(tmp_path: Path) -> None:
    source = (
        "class A:\n    def reset(self, **row):\n        return 'x'\n    def get_reward(self):\n        return 1 / 0\n"
    )
    episode = load_environments(MultiTurnConfig(env=_write(tmp_path, "a.py", source) + ":A"), _prompt).start({})
    assert episode.reward() is None and episode.reward_error == "ZeroDivisionError: division by zero"
