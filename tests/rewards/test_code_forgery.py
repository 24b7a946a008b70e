"""Forged code rewards (issue 45 item 1): a program that ends before the asserts run, or returns an object that
compares equal to anything, scores 0 in every test form, while real solutions still score 1. Real sandbox runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from easyrl.rewards import load_reward_function
from easyrl.sandbox import detect_isolation
from easyrl.sandbox.checks import assert_program


ROOT = Path(__file__).resolve().parents[2]
ASSERTS = [
    "assert inc(1) == 2",
    "assert abs(inc(0.5) - 1.5) < 1e-9",
    "assert math.isclose(inc(2), 3)",
    "assert inc(3) in (4, 5) and inc(-1) == 0",
]
REAL = "import math\ndef inc(x):\n    return x + 1"

# Each ends the program before the asserts run, hides a failure, or returns something that is not the answer.
FORGERIES = {
    "sys.exit": "import sys\nsys.exit(0)",
    "os._exit": "import os\nos._exit(0)",
    "raise SystemExit": "raise SystemExit",
    "exit inside the function": "def inc(x):\n    raise SystemExit(0)",
    "atexit hook": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef inc(x):\n    raise ValueError",
    "signal to itself": "import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: os._exit(0))\n"
    "os.kill(os.getpid(), signal.SIGUSR1)",
    "kill -9 itself": "import os\ndef inc(x):\n    os.kill(os.getpid(), 9)",
    "excepthook exits 0": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\ndef inc(x):\n    raise ValueError",
    "__eq__ always True": "class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
    "    __sub__ = lambda s, o: 0.0\n    __contains__ = lambda s, o: True\n    __hash__ = object.__hash__\n"
    "def inc(x):\n    return E()",
    "int subclass with __eq__": "class E(int):\n    __eq__ = lambda s, o: True\n    __sub__ = lambda s, o: 0.0\n"
    "    __hash__ = int.__hash__\ndef inc(x):\n    return E(0)",
    "exec and eval replaced": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True",
    "stdout closed, asserts wrong": "import os, sys\nsys.stdout.close()\nos.close(1)\ndef inc(x):\n    return 7",
    "marker read from its own source": "import os, re, sys\nm = re.search(r'@@easyrl-check-[0-9a-f]+@@', "
    "open(sys.argv[0]).read()).group(0)\nfor i in range(6):\n    os.write(1, f'\\n{m} {i} (\"a\", True)\\n'.encode())\n"
    "os._exit(0)",
    "math.isclose and abs patched": "import math, builtins\nmath.isclose = lambda *a, **k: True\n"
    "builtins.abs = lambda x: 0\ndef abs(x):\n    return 0\ndef inc(x):\n    return 100",
    "metaclass claims to be int": "class M(type):\n    __eq__ = lambda s, o: True\n    __hash__ = lambda s: hash(int)\n"
    "class E(metaclass=M):\n    __repr__ = lambda s: '2'\n    __sub__ = lambda s, o: 0.0\n"
    "def inc(x):\n    return E()",
    "a thread ends it": "import os, threading, time\ndef inc(x):\n"
    "    threading.Thread(target=lambda: (time.sleep(0.05), os._exit(0))).start()\n    time.sleep(2)",
}


def _reward() -> Any:
    try:
        detect_isolation()
    except RuntimeError as refusal:  # no isolation works here: the sandbox refuses to run by design
        pytest.skip(str(refusal))
    # A generous per-test time: no program here loops, and a loaded CI machine must not fail a real solution.
    kwargs = {"timeout_s": 15.0, "memory_mb": 512, "max_processes": 16, "max_output_bytes": 64 * 1024}
    return load_reward_function(str(ROOT / "reward_functions" / "code.py"), kwargs).fn


def _overall(code: str, truth: Any) -> list[float]:
    return [s["overall"] for s in _reward()([{"response": f"```python\n{code}\n```", "ground_truth": truth}])]


def test_every_forgery_of_assert_tests_scores_zero_and_the_real_solution_one() -> None:
    codes = [REAL, *FORGERIES.values()]
    scores = _reward()([{"response": f"```python\n{c}\n```", "ground_truth": ASSERTS} for c in codes])
    overall = dict(zip(["real", *FORGERIES], [s["overall"] for s in scores]))
    assert overall == {"real": 1.0, **dict.fromkeys(FORGERIES, 0.0)}


def test_a_half_right_solution_gets_its_pass_rate_and_plain_values_compare_as_python_does() -> None:
    # inc(x) = x + 1 only for x > 2, else 0: only the last assert holds.
    assert _overall("def inc(x):\n    return x + 1 if x > 2 else 0", ASSERTS) == [0.25]
    truth = [
        "assert pair(2) == (2, 2.0)",  # 2 == 2.0 as in Python
        "assert sorted(pair(1)) == [1, 1]",
        "assert pair(0) != [0, 0]",  # a tuple is not a list
        "assert set(pair(3)) == {3}",
        "assert pair(5)[0] is not None",
    ]
    assert _overall("def pair(x):\n    return (x, float(x))", truth) == [1.0]


def test_standard_dict_subclasses_and_namedtuples_are_read_as_their_builtin_base() -> None:
    counter = "from collections import Counter, namedtuple\nP = namedtuple('P', 'x y')\n"
    counter += "def freq(xs):\n    return Counter(xs)\ndef point(x):\n    return P(x, x)"
    truth = ["assert freq([1, 1, 2]) == {1: 2, 2: 1}", "assert point(3) == (3, 3)", "assert point(1).x == 1"]
    assert _overall(counter, truth) == [1.0]
    # A namedtuple that overrides an operator is the program's own object again.
    forged = "from collections import namedtuple\nclass P(namedtuple('P', 'x y')):\n    __eq__ = lambda s, o: True\n"
    forged += "def point(x):\n    return P(0, 0)"
    assert _overall(forged, truth[1:2]) == [0.0]


def test_generators_and_maps_are_checked_item_by_item() -> None:
    truth = ["assert list(evens([1, 2, 3, 4])) == [2, 4]", "assert sum(evens([2, 4])) == 6"]
    assert _overall("def evens(xs):\n    return filter(lambda v: v % 2 == 0, xs)", truth) == [1.0]
    assert _overall("def evens(xs):\n    yield from (v for v in xs if v % 2 == 0)", truth) == [1.0]
    forged = "class S:\n    __radd__ = lambda s, o: 6\n    __eq__ = lambda s, o: True\n"
    forged += "def evens(xs):\n    yield S()"
    assert _overall(forged, truth) == [0.0]


def test_no_expected_value_reaches_the_program() -> None:
    program = assert_program("def f(x):\n    return x", "assert f(12345) == 987654321")
    assert "987654321" not in program.source and "12345" in program.source and not program.clean_steps
    # An expected value that is not a literal is computed in a run of its own, without the program.
    program = assert_program("def f(x):\n    return x", "assert f(3) == set(range(777, 779)) != math.floor(2.5)")
    clean = repr(program.clean_steps)
    assert "777" not in program.source and "math.floor" not in program.source and "f(3)" in program.source
    assert "777" in clean and "math.floor" in clean and "f(3)" not in clean
    # What the test does with the program's value runs there too: the program's run only answers `f(0.5)`.
    program = assert_program("", "assert abs(f(0.5) - 1.5) < 1e-9")
    assert "1.5" not in program.source and "f(0.5)" in program.source
    assert [source for _, source, _ in program.clean_steps] == [f"abs(_easyrl_v{program.chains[0]} - 1.5)"]
    # A standard module's name the test calls (`array(3)`) may be the program's own function: it runs with it.
    program = assert_program("def array(n):\n    return [0] * n", "assert array(2) == list(range(2)) * 0 + [0, 0]")
    assert "array(2)" in program.source and "list(range(2))" in repr(program.clean_steps)


def test_a_program_that_reads_the_harness_frames_finds_no_expected_value() -> None:
    peek = (
        "import sys\ndef f(x):\n    frame = sys._getframe(1)\n    while 'steps' not in frame.f_locals:\n"
        "        frame = frame.f_back\n    for index, source in frame.f_locals['steps']:\n"
        "        if index != 'exec' and 'f(' not in source:\n            return eval(source)\n    return 0"
    )
    truth = ["assert f(3) == set([4, 5])", "assert f(1) == float('inf')", "assert f(2) == 6"]
    assert _overall(peek, truth) == [0.0]
    assert _overall("def f(x):\n    return {3: {4, 5}, 1: float('inf'), 2: 6}[x]", truth) == [1.0]


HUMANEVAL = (
    "METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
    "    assert abs(candidate(0.5) - 1.5) < 1e-6, 'close'\n    assert candidate(-1) == 0\n\ncheck(inc)\n"
)


def test_humaneval_check_functions_are_inlined_and_verified() -> None:
    assert _overall("def inc(x):\n    return x + 1", [HUMANEVAL]) == [1.0]
    assert _overall("import sys\nsys.exit(0)", [HUMANEVAL]) == [0.0]
    assert _overall(FORGERIES["__eq__ always True"], [HUMANEVAL]) == [0.0]
    looped = "def check(candidate):\n    assert candidate(0) == 1\n    for x in range(3):\n"
    looped += "        assert candidate(x) == x + 1\n\ncheck(inc)\n"
    with pytest.raises(ValueError, match="only top-level `assert`"):
        assert_program("", looped)


def test_a_test_without_a_top_level_assert_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="top-level `assert`"):
        assert_program("", "check(f)")  # no `def check` to inline
    with pytest.raises(ValueError, match="not Python"):
        assert_program("", "assert f(")
    with pytest.raises(ValueError, match="only top-level `assert`"):
        assert_program("", "assert f(0) == 1\nfor x in range(3):\n    assert f(x) == x + 1")


CALL = {"fn_name": "double", "inputs": [[1], [4]], "outputs": [2, 8]}
STDIO = {"inputs": ["1\n", "4\n"], "outputs": ["2\n", "8\n"]}


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "def double(x):\n    raise SystemExit(0)",
        "class E:\n    __eq__ = lambda s, o: True\ndef double(x):\n    return E()",
        "class E(int):\n    __eq__ = lambda s, o: True\ndef double(x):\n    return E(0)",
    ],
)
def test_call_based_forgeries_score_zero(code: str) -> None:
    assert _overall(code, CALL) == [0.0]


def test_call_based_and_stdio_real_solutions_score_one_and_early_exits_zero() -> None:
    assert _overall("def double(x):\n    return 2 * x", CALL) == [1.0]
    assert _overall("print(2 * int(input()))", STDIO) == [1.0]
    for early in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "import os, sys\nos.close(1)\nsys.exit(0)"):
        assert _overall(early, STDIO) == [0.0]
