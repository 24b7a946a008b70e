"""One process running a slice of the recipes in order, in one Ray session: `python -m tests.recipes.child`.

The runner (`python -m tests.recipes`) starts it, reads its progress and results as they come and bounds each recipe. Each result is
one JSON line, written and synced the moment the recipe ends; a failure also gets `OUT/failures/<recipe>.txt` at once
(the exception, its traceback, the last lines of this process's log and of the newest Ray worker logs), so nothing is
lost when a later recipe hangs or kills the process. SIGUSR1 dumps every thread's stack into the log (the runner sends
it before stopping a recipe that ran past its limit); SIGINT interrupts the recipe where it is.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.recipes.base import Context, RecipeFailed, check_rl
from tests.recipes.logs import tail, worker_log_tails
from tests.recipes.matrix import RECIPES


def run_one(name: str, gpu: bool, out: Path, log: Path, cache: dict[str, str]) -> dict[str, Any]:
    """Run the recipe `name`; its result (status, seconds, figures, effect or error) as one JSON-able dict."""
    recipe = RECIPES[name]
    work = out / "recipes" / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict[str, Any] = {"recipe": name, "group": recipe.group, "device": _device(gpu)}
    start = time.monotonic()
    try:
        outcome = recipe.run(Context(work, gpu, cache))
        if outcome.rows is not None:
            result |= check_rl(outcome.rows, outcome.staleness)
        result |= {"status": "pass", "effect": outcome.effect}
    except Exception as exc:  # every failure is this recipe's row; the next recipe still runs
        result |= {"status": "fail", "error": _one_line(exc)}
        _write_failure(out, name, exc, log)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    kind = "check failed" if isinstance(exc, RecipeFailed) else type(exc).__name__
    return f"{kind}: {text[:400]}"


def _write_failure(out: Path, name: str, exc: BaseException, log: Path) -> None:
    folder = out / "failures"
    folder.mkdir(parents=True, exist_ok=True)
    text = (
        f"recipe {name}: {_one_line(exc)}\n\n"
        + "".join(traceback.format_exception(exc))
        + f"\n=== the last lines of the driver's log ({log})\n{tail(log)}\n"
        + f"\n=== the newest Ray worker logs\n{worker_log_tails()}\n"
    )
    _write_synced(folder / f"{name}.txt", text, "w")


def _write_synced(path: Path, text: str, mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _device(gpu: bool) -> str:
    import torch

    return torch.cuda.get_device_name(0) if gpu else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--names", required=True, help="comma-separated recipe names, run in this order")
    parser.add_argument("--tag", required=True, help="this process's name: its log and results files")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the runner asks for the stacks before a stop
    folder = args.out / "recipes"
    log, results, progress = (folder / f"{args.tag}.{ext}" for ext in ("log", "jsonl", "progress"))
    gpu = args.device == "cuda"
    os.chdir(Path(__file__).resolve().parents[2])  # configs name files relative to the repository root
    from easyrl.distributed import init_ray

    # One Ray session for every recipe of this process (workers still start per run); the engine's env as a run's
    init_ray(env_vars={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if gpu else None, num_cpus=None if gpu else 4)
    cache: dict[str, str] = {}
    for name in args.names.split(","):
        # the runner's clock for this recipe starts here (CLOCK_MONOTONIC: the same in every process of the machine)
        _write_synced(progress, json.dumps({"recipe": name, "started": time.monotonic()}), "w")
        result = run_one(name, gpu, args.out, log, cache)
        _write_synced(results, json.dumps(result) + "\n", "a")
        print(f"recipe {name}: {result['status']} in {result['seconds']} s", flush=True)
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
