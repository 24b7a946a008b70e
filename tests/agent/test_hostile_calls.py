"""Whatever the model writes or a tool does, the trajectory gets an `Error:` observation and the driver lives on
(issue 45, items 3, 6 and 7): calls nested past the recursion limit or holding numbers past Python's digit limit,
results that cannot be shown or hold lone surrogates, arguments of the wrong type or size, a tool that calls
`os._exit` or forks, and a hung tool called again and again."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

from easyrl.agent import Episode, parse_tool_calls, run_tool_calls, tool_from_function
from easyrl.agent.calls import MAX_ARGUMENT_CHARS, argument_error
from easyrl.agent.guard import CallGuard


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: what to say
    """
    return text


def count(n: int, items: list[int], ratio: float, flag: bool) -> int:
    """Count.

    Args:
        n: a number
        items: numbers
        ratio: a fraction
        flag: a switch
    """
    return n


def surrogate() -> str:
    """Return a text with a lone surrogate (as a tool decoding bytes with `surrogateescape` may)."""
    return "ok \udc80 done"


def huge_int() -> int:
    """Return an integer past Python's digit limit for str()."""
    return 10**100_000


def deep_list() -> list[Any]:
    """Return a list nested 100,000 levels deep."""
    value: list[Any] = []
    for _ in range(100_000):
        value = [value]
    return value


def hard_exit(code: int) -> None:
    """End the process at once (what a careless tool may do).

    Args:
        code: the exit status
    """
    os._exit(code)


def forks() -> int:
    """Fork the process."""
    pid = os.fork()
    if pid == 0:  # never reached: the fork is refused
        os._exit(0)
    return pid


def stuck(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def _episode(*fns: Any, guard: CallGuard | None = None) -> Episode:
    tools = [tool_from_function(fn, __file__) for fn in fns]
    episode = Episode("test", None, {t.name: t.fn for t in tools}, [t.schema for t in tools], [])
    if guard is not None:
        episode.guard = guard
    return episode


def _call(name: str, arguments: dict[str, Any] | str) -> str:
    body = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>{{"name": "{name}", "arguments": {body}}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", "nested too deeply"),
        (_call("echo", '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
        (_call("echo", '{"text": 1' + "0" * 100_000 + "}"), "Exceeds the limit"),
        (_call("echo", json.dumps('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}")), "nested too deeply"),
    ],
)
def test_calls_nested_past_the_recursion_limit_or_with_huge_numbers_are_error_observations(
    text: str, error: str
) -> None:
    [call] = parse_tool_calls(text)
    assert call.error is not None and error in call.error
    [[obs]] = run_tool_calls([(_episode(echo), [call])], 1.0, 100, 1)
    assert obs.error and obs.content.startswith("Error: ") and error in obs.content


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (
            {"n": "3", "items": [1], "ratio": 0.5, "flag": True},
            "argument 'n' of count is string; the tool takes integer",
        ),
        ({"n": True, "items": [1], "ratio": 0.5, "flag": True}, "argument 'n' of count is boolean"),
        ({"n": 1, "items": [1, "x"], "ratio": 0.5, "flag": True}, "argument 'items' of count item 1 is string"),
        ({"n": 1, "items": [1], "ratio": 1e999, "flag": True}, "argument 'ratio' of count is a non-finite number"),
        (
            {"n": 1, "items": [1], "ratio": 0.5, "flag": 1},
            "argument 'flag' of count is integer; the tool takes boolean",
        ),
    ],
)
def test_arguments_are_checked_against_the_schema_types_before_the_call(arguments: dict, error: str) -> None:
    text = _call("count", json.dumps(arguments).replace("Infinity", "1e999"))  # the model writes 1e999
    [[obs]] = run_tool_calls([(_episode(count), parse_tool_calls(text))], 1.0, 200, 1)
    assert obs.error and obs.content.startswith(f"Error: bad arguments for count: {error}") and not obs.failed


def test_a_good_call_still_passes_the_checks() -> None:
    text = _call("count", {"n": 7, "items": [1, 2], "ratio": 0.5, "flag": False})
    [[obs]] = run_tool_calls([(_episode(count), parse_tool_calls(text))], 1.0, 200, 1)
    assert obs.content == "7" and not obs.error


def test_an_oversized_or_overdeep_argument_is_refused_naming_it() -> None:
    schema = tool_from_function(echo, __file__).schema
    big = argument_error("echo", {"text": "x" * (MAX_ARGUMENT_CHARS + 1)}, schema)
    assert big == f"argument 'text' of echo holds more than {MAX_ARGUMENT_CHARS} characters"
    deep: list[Any] = []
    for _ in range(500):
        deep = [deep]
    assert argument_error("echo", {"text": deep}, schema) == "argument 'text' of echo is nested deeper than 64 levels"


@pytest.mark.parametrize(
    ("tool", "expected"),
    [
        (surrogate, "ok \ufffd done"),  # replaced: a tokenizer cannot encode a lone surrogate
        (huge_int, "Error: ValueError: the tool returned a int that cannot be shown as text"),
        (deep_list, "Error: ValueError: the tool returned a list that cannot be shown as text"),
    ],
)
def test_results_that_cannot_be_shown_as_they_are_become_text_or_an_error(tool: Any, expected: str) -> None:
    text = _call(tool.__name__, {})
    [[obs]] = run_tool_calls([(_episode(tool), parse_tool_calls(text))], 5.0, 100, 1)
    assert obs.content == expected
    obs.message()["content"].encode("utf-8")  # what the chat template renders encodes


def test_a_tool_calling_os_exit_or_fork_is_refused_naming_it_and_the_driver_lives_on() -> None:
    calls = parse_tool_calls(_call("hard_exit", {"code": 3}) + _call("forks", {}) + _call("echo", {"text": "hi"}))
    [[exited, forked, after]] = run_tool_calls([(_episode(hard_exit, forks, echo), calls)], 5.0, 300, 1)
    assert exited.content == "Error: the tool hard_exit tried to end the training process (os._exit); refused"
    assert forked.content.startswith("Error: the tool forks called os.fork") and "refused" in forked.content
    assert exited.failed and forked.failed and after.content == "hi"
    assert threading.main_thread().is_alive()  # this test process is the driver: still here


def test_k_calls_of_a_hung_tool_cost_one_deadline_and_one_thread_per_trajectory() -> None:
    episode = _episode(stuck, echo, guard=CallGuard(max_hung=4))
    threads = threading.active_count()
    calls = parse_tool_calls("".join(_call("stuck", {"seconds": 30}) for _ in range(5)) + _call("echo", {"text": "x"}))
    start = time.perf_counter()
    [observations] = run_tool_calls([(episode, calls)], 0.3, 200, 1)
    assert time.perf_counter() - start < 0.3 + 1.0 + 1.0  # one deadline (and the python tool's grace), not five
    first, *again, last = observations
    assert first.timed_out and first.failed and "the tool stuck did not finish within 0.3s" in first.content
    assert all(o.content == "Error: the tool stuck did not finish an earlier call; not called again" for o in again)
    assert last.content == "x"
    assert threading.active_count() - threads <= 1  # one hung thread left, not five


def test_past_max_hung_calls_an_owner_is_refused_at_once_across_trajectories() -> None:
    guard = CallGuard(max_hung=2)
    jobs = [(_episode(stuck, guard=guard), parse_tool_calls(_call("stuck", {"seconds": 30}))) for _ in range(5)]
    start = time.perf_counter()
    results = run_tool_calls(jobs, 0.2, 200, 1)  # one at a time: the first two hang, the rest are refused
    assert time.perf_counter() - start < 2 * (0.2 + 1.0) + 1.0
    contents = [obs.content for [obs] in results]
    assert sum(obs.timed_out for [obs] in results) == 2
    assert all("was not called: 2 earlier call(s) of tool stuck are still running" in c for c in contents[2:])
    assert guard.hung("tool stuck") == 2
