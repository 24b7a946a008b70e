"""Run the recipe matrix: `python -m tests.recipes --device cuda --out OUT [--jobs 2] [--budget 440] [--only a,b]`.

The recipes are split over `--jobs` processes (`tests.recipes.child`) that run side by side on the one device, each
its slice in order in one Ray session. Each recipe is bounded by its own limit: past it, the process's stacks are
dumped into its log (SIGUSR1), it is interrupted (SIGINT, so the run in progress unwinds and says where), then its
whole process group is killed (Ray's processes with it), the recipe is recorded as timed out with its log's end, and
a fresh process goes on with the rest of the slice. A process that dies records its recipe as crashed the same way.
Past `--budget` seconds every process is stopped and what did not run says so. Results: `OUT/recipes.jsonl` (one
line per recipe, in the matrix's order) and `OUT/recipes.table.md`; the exit status is 0 when every recipe passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.recipes.bounded import stop, stuck_at
from tests.recipes.logs import tail
from tests.recipes.matrix import CPU_SMOKE, MATRIX, RECIPES


STARTUP_LIMIT_S = 90.0
"""A process's start-up (imports, Ray) before its first recipe, or between two recipes."""
CPU_SCALE = 4.0
"""A recipe's limit on a CPU machine over its GPU limit (2 cores run the same tiny steps several times slower)."""


@dataclass
class Slot:
    """One process slot: the recipes it still owes, and the process running them now."""

    index: int
    pending: list[str]
    proc: subprocess.Popen[bytes] | None = None
    tag: str = ""
    attempts: int = 0
    seen: int = 0
    """Result lines already read from the current process's results file."""
    since: float = 0.0
    """When the recipe now running (the first pending: a process runs its slice in order) started: the process's
    start (its imports and Ray's start-up count against its first recipe) or the previous recipe's result."""


def _paths(out: Path, tag: str) -> tuple[Path, Path]:
    folder = out / "recipes"
    return folder / f"{tag}.log", folder / f"{tag}.jsonl"


def _running(slot: Slot, out: Path) -> tuple[str | None, float, float]:
    """(the recipe the slot's process runs, since when, its limit): the first pending one (a process runs its slice
    in order) once the process says it started it; before that, the process's start-up with `STARTUP_LIMIT_S`."""
    name = slot.pending[0] if slot.pending else None
    try:
        state = json.loads((out / "recipes" / f"{slot.tag}.progress").read_text())
    except (OSError, ValueError):
        state = {}
    if name is not None and state.get("recipe") == name:
        return name, float(state["started"]), RECIPES[name].limit_s
    return name, slot.since, STARTUP_LIMIT_S


def _start(slot: Slot, device: str, out: Path) -> None:
    slot.attempts += 1
    slot.tag, slot.seen, slot.since = f"p{slot.index}-{slot.attempts}", 0, time.monotonic()
    log, _ = _paths(out, slot.tag)
    cmd = [sys.executable, "-m", "tests.recipes.child", "--device", device, "--out", str(out)]
    cmd += ["--names", ",".join(slot.pending), "--tag", slot.tag]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": _repo() + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with open(log, "ab") as sink:  # the child keeps its own handle
        slot.proc = subprocess.Popen(cmd, cwd=_repo(), env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _repo() -> str:
    return str(Path(__file__).resolve().parents[2])


def _collect(slot: Slot, out: Path, results: dict[str, dict[str, Any]]) -> None:
    """Take the results the slot's process wrote since the last look."""
    _, jsonl = _paths(out, slot.tag)
    if not jsonl.exists():
        return
    lines = [line for line in jsonl.read_text().splitlines() if line.endswith("}")]  # whole lines only
    for line in lines[slot.seen :]:
        result = json.loads(line)
        results[result["recipe"]] = result
        if result["recipe"] in slot.pending:
            slot.pending.remove(result["recipe"])
        slot.since = time.monotonic()
    slot.seen = len(lines)


def _stop(slot: Slot) -> None:
    assert slot.proc is not None
    stop(slot.proc)
    slot.proc = None


def _failed(name: str, status: str, slot: Slot, out: Path, seconds: float) -> dict[str, Any]:
    """The row of a recipe whose process was stopped or died, with the end of its log (also in OUT/failures/)."""
    log, _ = _paths(out, slot.tag)
    end = tail(log)
    folder = out / "failures"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.txt").write_text(f"recipe {name}: {status}\n\n=== the last lines of {log}\n{end}\n")
    last = [line for line in end.splitlines() if line.strip()][-1:] or [""]
    where = stuck_at(end)
    said = f"{status}; stuck at {where}" if where else f"{status}; last log line: {last[0][:300]}"
    return {
        "recipe": name,
        "group": RECIPES[name].group,
        "status": status,
        "seconds": round(seconds, 1),
        "error": said,
    }


def run(names: list[str], device: str, out: Path, jobs: int, budget_s: float) -> dict[str, dict[str, Any]]:
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    scale = 1.0 if device == "cuda" else CPU_SCALE
    slots = [Slot(i, names[i::jobs]) for i in range(jobs)]
    results: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    while any(s.pending for s in slots):
        over_budget = time.monotonic() - start > budget_s
        for slot in slots:
            if slot.proc is None and slot.pending and not over_budget:
                _start(slot, device, out)
            if slot.proc is None:
                continue
            _collect(slot, out, results)
            name, since, limit = _running(slot, out)
            ran = time.monotonic() - since
            if name is not None and (over_budget or ran > limit * scale):
                _stop(slot)
                _collect(slot, out, results)  # it may have finished while being stopped
                if name in slot.pending:
                    why = "stage budget" if over_budget else f"a limit of {limit * scale:.0f} s"
                    if limit == STARTUP_LIMIT_S:
                        why += ", in the process's start-up"
                    results[name] = _failed(name, f"timed out after {ran:.0f} s ({why})", slot, out, ran)
                    slot.pending.remove(name)
            elif slot.proc.poll() is not None:  # exited: done, or died in a recipe
                _collect(slot, out, results)
                if name is not None and name in slot.pending:
                    results[name] = _failed(name, f"crashed (exit {slot.proc.returncode})", slot, out, ran)
                    slot.pending.remove(name)
                slot.proc = None
        if over_budget and all(s.proc is None for s in slots):
            for slot in slots:
                for name in slot.pending:
                    results[name] = {"recipe": name, "group": RECIPES[name].group, "status": "not run (stage budget)"}
                slot.pending.clear()
        time.sleep(0.5)
    return results


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| recipe | group | status | seconds | token-prob error | checked |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = r.get("token_prob_error")
        figure = f"{error:.4f}" if isinstance(error, float) else ""
        said = (r.get("effect") if r["status"] == "pass" else r.get("error")) or ""
        said = said.replace("|", "/")
        lines.append(f"| {r['recipe']} | {r['group']} | {r['status']} | {r.get('seconds', '')} | {figure} | {said} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated recipe names (default: all on cuda, CPU_SMOKE on cpu)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="processes running recipes side by side on the device")
    parser.add_argument("--budget", type=float, default=440.0, help="seconds for the whole matrix")
    args = parser.parse_args(argv)
    default = [r.name for r in MATRIX] if args.device == "cuda" else list(CPU_SMOKE)
    names = list(dict.fromkeys(args.only.split(","))) if args.only else default
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    cpu_less = [n for n in names if args.device == "cpu" and not RECIPES[n].cpu]
    if cpu_less:
        parser.error(f"recipe(s) {cpu_less} have no CPU form (GPU-only features or engines)")
    results = run(names, args.device, args.out, max(1, args.jobs), args.budget)
    rows = [results[n] for n in names]
    with open(args.out / "recipes.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    text = table(rows)
    (args.out / "recipes.table.md").write_text(text)
    print(text, end="")
    passed = sum(r["status"] == "pass" for r in rows)
    print(f"{passed} of {len(rows)} recipes passed")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
