"""Tool calls: whatever the model writes, the trajectory gets an observation and the run goes on.

Parsing (Hermes `<tool_call>` JSON), and running: unknown tools, bad arguments, a tool that raises or exits, one that
hangs past its deadline, huge output; and the built-in `python` tool in the sandbox."""

from __future__ import annotations

import time

import pytest

from easyrl.agent import Episode, parse_tool_calls, python_tool, run_tool_calls, tool_from_function
from easyrl.agent.calls import has_tool_call


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def explode(x: int) -> int:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError(f"boom {x}")


def leave(code: int) -> None:
    """Exit the process (a tool must never end the run).

    Args:
        code: the exit status
    """
    raise SystemExit(code)


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def flood(n: int) -> str:
    """Return a long text.

    Args:
        n: its length
    """
    return "x" * n


def listing(n: int) -> list[int]:
    """A list.

    Args:
        n: its length
    """
    return list(range(n))


def _episode(*fns) -> Episode:
    tools = [tool_from_function(fn, __file__) for fn in fns]
    return Episode("test", None, {t.name: t.fn for t in tools}, [t.schema for t in tools], [])


def test_parses_hermes_calls_with_text_around_and_several_per_turn() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call> done'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("add", {"a": 3, "b": 4}, None),  # arguments given as a JSON string
    ]
    assert parse_tool_calls("no call here") == [] and not has_tool_call("no call here")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "is a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "is a JSON object"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "without its </tool_call>"),
    ],
)
def test_a_malformed_call_is_an_error_observation_not_a_crash(text: str, error: str) -> None:
    calls = parse_tool_calls(text)
    assert has_tool_call(text) and len(calls) == 1 and error in (calls[0].error or "")
    [[observation]] = run_tool_calls([(_episode(add), calls)], 1.0, 100, 2)
    assert observation.error and observation.content.startswith("Error: ") and error in observation.content


def test_every_failure_of_a_call_becomes_an_observation_and_the_good_calls_still_run() -> None:
    episode = _episode(add, explode, leave, flood, listing)
    text = "".join(
        f"<tool_call>{call}</tool_call>"
        for call in (
            '{"name": "add", "arguments": {"a": 2, "b": 3}}',
            '{"name": "sub", "arguments": {"a": 2, "b": 3}}',  # no such tool
            '{"name": "add", "arguments": {"a": 2}}',  # a missing argument
            '{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}',  # an unknown one
            '{"name": "explode", "arguments": {"x": 7}}',
            '{"name": "leave", "arguments": {"code": 3}}',  # SystemExit in a tool
            '{"name": "flood", "arguments": {"n": 500}}',
            '{"name": "listing", "arguments": {"n": 3}}',
        )
    )
    [obs] = run_tool_calls([(episode, parse_tool_calls(text))], 1.0, 50, 2)
    assert obs[0].content == "5" and not obs[0].error
    assert "no tool named 'sub'" in obs[1].content and "add, explode, flood, leave, listing" in obs[1].content
    assert "bad arguments for add" in obs[2].content and "bad arguments for add" in obs[3].content
    assert obs[4].content == "Error: RuntimeError: boom 7"
    assert obs[5].content == "Error: SystemExit: 3"
    assert obs[6].content == "x" * 50 + "... [450 more characters cut]" and not obs[6].error
    assert obs[7].content == "[0, 1, 2]"  # non-text results as JSON
    assert [o.error for o in obs] == [False, True, True, True, True, True, False, False]


def test_a_hung_tool_times_out_without_holding_the_others() -> None:
    start = time.perf_counter()
    jobs = [
        (_episode(hang), parse_tool_calls('<tool_call>{"name": "hang", "arguments": {"seconds": 30}}</tool_call>')),
        (_episode(add), parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')),
    ]
    [[slow], [fast]] = run_tool_calls(jobs, 0.5, 100, 2)
    assert time.perf_counter() - start < 5
    assert slow.timed_out and slow.error and "did not finish within 0.5s" in slow.content
    assert fast.content == "2" and not fast.timed_out


def test_a_function_without_hints_or_documented_arguments_is_refused_naming_it() -> None:
    from easyrl.agent import AgentLoadError

    def untyped(x):  # type: ignore[no-untyped-def]
        """No hints."""

    with pytest.raises(AgentLoadError, match=r"tool untyped in here: .*type hint"):
        tool_from_function(untyped, "here")


def test_the_python_tool_runs_code_in_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EASYRL_TEST_SECRET", "hunter2")
    tool = python_tool(timeout_s=5.0, max_output_chars=1000)
    assert tool.schema["function"]["name"] == "python"
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    assert tool.fn(code="print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in tool.fn(code="print(1)\n1/0")
    assert "no output" in tool.fn(code="x = 1")
    assert tool.fn(code="import os; print(os.environ.get('EASYRL_TEST_SECRET'))") == "None\n"
    assert "Error: timed out after 1s" in python_tool(1.0, 100).fn(code="while True: pass")
