"""Every selected test id its own bounded pytest run: `python -m tests.recipes.each_test --out OUT -- -m gpu tests`.

One pytest process per test id, in a session of its own, with its own limit: a hang costs that test's limit, not the
stage, and is stopped so that it says where it was (`bounded.stop`: stacks, SIGINT so pytest prints its summary, then
the process group with Ray's processes). The conftest writes each failure into `OUT/failures/` the moment it happens
(`EASYRL_FAILURES_DIR`). Results: `OUT/tests.jsonl` and `OUT/tests.table.md`; exit status 0 when none failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import FAILURES_ENV, STACKS_ENV
from tests.recipes.bounded import stop, stuck_at
from tests.recipes.logs import tail


REPO = Path(__file__).resolve().parents[2]
DEFAULT_LIMIT_S = 90.0
"""A GPU test's limit (its pytest start-up included) unless `LIMITS_S` names it."""
LIMITS_S = {
    "tests/workers/test_rollout_vl_vllm.py": 150.0,
    "tests/trainer/test_families_e2e.py": 150.0,
    "tests/workers/test_memory_gpu.py": 120.0,
}
"""Limits by file (a prefix of the test id), for the runs that start a real engine and train."""


def collect(selection: list[str]) -> list[str]:
    """The test ids pytest selects with `selection` (its arguments: paths, `-m`, `-k`)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"pytest could not collect {selection}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def limit_of(test_id: str, default: float = DEFAULT_LIMIT_S) -> float:
    return next((s for prefix, s in LIMITS_S.items() if test_id.startswith(prefix)), default)


def _safe(test_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)[-150:]


def run_one(test_id: str, out: Path, limit_s: float) -> dict[str, Any]:
    log, stacks = (out / "tests" / f"{_safe(test_id)}.{ext}" for ext in ("log", "stacks"))
    env = {**os.environ, FAILURES_ENV: str(out / "failures"), STACKS_ENV: str(stacks), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", test_id]
    start = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc: int | None = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        rc = None
    seconds = round(time.monotonic() - start, 1)
    end = tail(log)
    summary = next((line for line in reversed(end.splitlines()) if re.search(r"\b(passed|failed|skipped|error)", line)), "")  # fmt: skip
    if rc is None:  # where it hung: the main thread's stack when stopped, or pytest's line of the interrupt
        interrupted = re.search(r"^(\S+:\d+): KeyboardInterrupt", end, re.M)
        where = stuck_at(tail(stacks, 400)) or (interrupted.group(1) if interrupted else "")
        status = f"timed out after {limit_s:.0f} s" + (f", stuck at {where}" if where else "")
    elif rc == 0:
        status = "skipped" if "skipped" in summary and "passed" not in summary else "pass"
    else:
        status = f"fail (exit {rc})"
    return {"test": test_id, "status": status, "seconds": seconds, "summary": summary.strip("= ")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for all the runs")
    parser.add_argument("--limit", type=float, default=DEFAULT_LIMIT_S, help="a test's limit unless LIMITS_S names it")
    parser.add_argument("selection", nargs="+", help="pytest's selection: paths, -m MARK, -k EXPR (after --)")
    args = parser.parse_args(argv)
    (args.out / "tests").mkdir(parents=True, exist_ok=True)
    start, rows = time.monotonic(), []
    for test_id in collect(args.selection):
        left = args.budget - (time.monotonic() - start)
        if left < 15:  # not enough for a pytest start-up: say so instead of starting it
            rows.append({"test": test_id, "status": "not run (stage budget)", "seconds": 0.0, "summary": ""})
            continue
        row = run_one(test_id, args.out, min(limit_of(test_id, args.limit), left))
        print(f"{row['status']:>12}  {row['seconds']:6.1f} s  {test_id}", flush=True)
        rows.append(row)
    with open(args.out / "tests.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = ["| test | status | seconds | pytest's summary |", "|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['status']} | {r['seconds']} | {r['summary']} |" for r in rows]
    (args.out / "tests.table.md").write_text("\n".join(lines) + "\n")
    bad = [r for r in rows if r["status"] not in ("pass", "skipped")]
    print(f"{len(rows) - len(bad)} of {len(rows)} test ids passed or skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
