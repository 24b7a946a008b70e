"""Code reward: run the response's last fenced python block against the row's tests in a sandbox.

The ground truth holds the tests, as a dict or as its JSON text, in one of three forms:

- stdin/stdout (APPS/TACO): ``{"inputs": [...], "outputs": [...]}``; each input is fed on stdin and the program's
  stdout must equal the output line by line, each line's surrounding whitespace stripped.
- call-based (APPS/TACO with ``fn_name``, as Skywork-OR1 and DeepCoder data hold it):
  ``{"fn_name": "f", "inputs": [[args...], ...], "outputs": [ret, ...]}``; ``f`` (or ``Solution().f``) is called
  with each argument list and its return value must equal the output (compared as JSON).
- assert statements: a list of strings (or ``{"asserts": [...]}``), each checked after the code by a harness whose
  verdict the program cannot forge (:mod:`easyrl.sandbox.checks`): the operands of each assert are evaluated in
  the sandbox and reported as plain values, the comparison is made here, and a program that ends before every
  operand was reported (an early exit of any kind) fails the test.

Each test runs in its own sandbox (:mod:`easyrl.sandbox`: no network, read-only filesystem but a scratch dir, no
inherited environment, limits on CPU, memory, processes and output) with ``timeout_s`` seconds; once a row has
used ``total_timeout_s`` its remaining tests fail without running. With ``sandbox_url`` (a SandboxFusion server's
base URL, e.g. ``http://sandbox:8080``) the tests run there (``POST /run_code``) instead, for scale. A ground truth in none of these forms raises an
error naming what is wrong, which the reward manager counts as that sample's error.

Scores: ``overall`` = ``pass_rate`` = the fraction of tests passed; ``accuracy`` = 1 only when all pass;
``format`` = the response has a fenced python block; ``timeout``, ``memory``, ``disk``, ``output_limit`` and
``sandbox_error`` = 1 when any test of the row ended so (their batch means count the contained escapes)::

    worker.reward.reward_function=reward_functions/code.py:compute_score
    worker.reward.reward_function_kwargs={timeout_s: 6, total_timeout_s: 60, memory_mb: 1024}
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from easyrl.sandbox import SandboxLimits, SandboxResult, run_code, run_code_remote
from easyrl.sandbox.checks import AssertProgram, assert_program


REWARD_TYPE = "batch"
REWARD_NAME = "code"

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_COUNTED = ("timeout", "memory", "disk", "output_limit", "sandbox_error")


@dataclass(frozen=True)
class _Test:
    """One test: the program to run, its stdin, and what its stdout must show."""

    source: str
    stdin: str
    expected: Any
    kind: str  # "stdio", "call" or "assert"
    marker: str = ""
    checks: AssertProgram | None = None  # for "assert": reads the verdict from the harness's value lines


def last_code_block(response: str) -> str | None:
    """The last fenced block marked python (or unmarked) in ``response``; ``None`` when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _call_args(value: Any) -> list[Any]:
    # TACO sometimes stores each argument list as JSON text, one argument per line.
    if isinstance(value, str):
        return [json.loads(line) for line in value.splitlines() if line.strip()]
    return list(value) if isinstance(value, list) else [value]


def _call_source(code: str, fn_name: str, args: list[Any], marker: str) -> str:
    # The marker is random per test, so the program cannot print a fake result line.
    return (
        f"{code}\n\n"
        "import json as _easyrl_json, sys as _easyrl_sys\n"
        f"_easyrl_fn = globals().get({fn_name!r}) or getattr(globals()['Solution'](), {fn_name!r})\n"
        f"_easyrl_out = _easyrl_fn(*_easyrl_json.loads({json.dumps(args)!r}))\n"
        f"_easyrl_sys.stdout.write('\\n{marker}' + _easyrl_json.dumps(_easyrl_out, default=repr) + '\\n')\n"
    )


def parse_tests(ground_truth: Any, code: str) -> list[_Test]:
    """The tests of one row; raises ``ValueError`` naming what is wrong with a malformed ground truth."""
    tests = ground_truth
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"code reward: ground_truth is text but not JSON ({error}): {ground_truth[:200]!r}"
            ) from None
    if isinstance(tests, dict) and "asserts" in tests:
        tests = tests["asserts"]
    if isinstance(tests, list):
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("code reward: a list ground_truth must be a non-empty list of assert statements")
        programs = [assert_program(code, statement) for statement in tests]
        return [_Test(p.source, "", None, "assert", p.marker, p) for p in programs]
    if not isinstance(tests, dict) or not {"inputs", "outputs"} <= tests.keys():
        raise ValueError(
            "code reward: ground_truth must be {'inputs': [...], 'outputs': [...]} (optionally with 'fn_name'), "
            f"a list of assert statements, or their JSON text; got {str(ground_truth)[:200]!r}"
        )
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError(
            f"code reward: ground_truth 'inputs' and 'outputs' must be non-empty lists of one length; got "
            f"{type(inputs).__name__} of {len(inputs) if isinstance(inputs, list) else '?'} and "
            f"{type(outputs).__name__} of {len(outputs) if isinstance(outputs, list) else '?'}"
        )
    if fn_name:
        found = []
        for args, expected in zip(inputs, outputs):
            marker = f"@@easyrl-result-{secrets.token_hex(8)}@@"
            found.append(
                _Test(_call_source(code, str(fn_name), _call_args(args), marker), "", expected, "call", marker)
            )
        return found
    return [_Test(code, _as_text(given), _as_text(expected), "stdio") for given, expected in zip(inputs, outputs)]


def _passed(test: _Test, stdout: str) -> bool:
    """A stdin/stdout or call-based test's verdict (assert tests are judged by their AssertProgram)."""
    if test.kind == "stdio":
        return _lines(stdout) == _lines(test.expected)
    _, found, result = stdout.rpartition(test.marker)
    if not found:
        return False
    try:
        value = json.loads(result.strip())
    except json.JSONDecodeError:
        return False
    expected = json.loads(json.dumps(test.expected, default=repr))  # tuples as lists, like the result
    # APPS wraps some call-based outputs in a one-item list.
    return value == expected or [value] == expected


def _run(source: str, stdin: str, limits: SandboxLimits, isolation: str | None, url: str | None) -> SandboxResult:
    return run_code_remote(url, source, stdin, limits) if url else run_code(source, stdin, limits, isolation)


def score_one(
    response: str,
    ground_truth: Any,
    limits: SandboxLimits,
    total_timeout_s: float,
    isolation: str | None = None,
    sandbox_url: str | None = None,
) -> dict[str, float]:
    """Scores of one response (see the module docstring)."""
    code = last_code_block(response)
    scores = {"overall": 0.0, "pass_rate": 0.0, "accuracy": 0.0, "format": float(code is not None)}
    scores.update(dict.fromkeys(_COUNTED, 0.0))
    tests = parse_tests(ground_truth, code or "")  # a malformed ground truth fails even without code
    if code is None:
        return scores
    passed, deadline = 0, time.monotonic() + total_timeout_s
    for test in tests:
        if time.monotonic() >= deadline:
            scores["timeout"] = 1.0
            break  # the row's budget is spent: the tests left count as failed
        if test.checks is not None:
            # Exit status 0 proves nothing: the verdict comes from the values the harness reported.
            ok, results = test.checks.judge(lambda source: _run(source, "", limits, isolation, sandbox_url))
        else:
            results = [_run(test.source, test.stdin, limits, isolation, sandbox_url)]
            ok = results[0].status == "ok" and _passed(test, results[0].stdout)
        for result in results:
            if result.status in _COUNTED:
                scores[result.status] = 1.0
        passed += ok
    rate = passed / len(tests)
    scores.update(overall=rate, pass_rate=rate, accuracy=float(passed == len(tests)))
    return scores


def compute_score(
    reward_inputs: list[dict[str, Any]],
    timeout_s: float = 6.0,
    total_timeout_s: float = 60.0,
    memory_mb: int = 1024,
    max_processes: int = 32,
    max_output_bytes: int = 1 << 20,
    max_disk_mb: int = 64,
    max_parallel: int | None = None,
    isolation: str | None = None,
    sandbox_url: str | None = None,
) -> list[dict[str, float]]:
    """Batch reward: one dict of scores per input (``response``, ``ground_truth``), rows run in parallel."""
    limits = SandboxLimits(
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_output_bytes=max_output_bytes,
        max_disk_mb=max_disk_mb,
    )
    workers = max_parallel or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(
                score_one, item["response"], item["ground_truth"], limits, total_timeout_s, isolation, sandbox_url
            )
            for item in reward_inputs
        ]
        return [future.result() for future in futures]


main = compute_score
