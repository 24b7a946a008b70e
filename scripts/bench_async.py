"""Synchronous vs asynchronous rollouts with carry-over (`trainer.max_staleness` 0, 1, 2) on the digits demo, with
the engines colocated (the HybridEngine: they take turns with training) and on a rollout worker of their own
(`worker.rollout.placement: separate`: with S >= 1 it generates while the actor trains), side by side in one
invocation: a reward that takes 50 ms per call and long-tailed response lengths (`data.max_response_length` 48: the
demo's sampled responses are 6-9 tokens on average, with a tail to 20-40 early in training). Each setting runs
`--repeats` times in a mirrored order (a b c c b a ...) so that a machine whose load drifts during the benchmark does
not favour one of them. Prints one JSON line per run, then a Markdown table.

    python scripts/bench_async.py --steps 40 --repeats 1
    python scripts/bench_async.py --settings colocated:0 colocated:1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent

SLOW_REWARD = '''"""The digits reward, 50 ms per call (one call per sample: REWARD_TYPE sequential)."""
import importlib.util
import time

REWARD_TYPE = "sequential"
_spec = importlib.util.spec_from_file_location("digits", {digits!r})
_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_digits)


def compute_score(reward_input):
    time.sleep({seconds})
    return _digits.compute_score([reward_input])[0]
'''


def run(setting: str, steps: int, reward: Path, folder: Path, extra: list[str]) -> dict[str, float]:
    """One training run of the demo from the command line (`setting`: placement:max_staleness); its wall time and
    what its log says."""
    placement, staleness = setting.split(":")[0], int(setting.split(":")[1])
    # separate: one rollout worker (a CPU slot here) beside the demo's 2 actor workers
    where = ["worker.rollout.placement=separate", "worker.rollout.n_gpus=1"] if placement == "separate" else []
    cmd = [
        sys.executable,
        "-m",
        "easyrl.cli",
        "train",
        str(REPO / "configs" / "demo.yaml"),
        "trainer.n_gpus_per_node=2",  # the layout of the figures recorded in docs/benchmarks.md (2 workers)
        f"trainer.max_staleness={staleness}",
        f"trainer.max_steps={steps}",
        "data.max_response_length=48",
        f"worker.reward.reward_function={reward}:compute_score",
        "trainer.val_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.save_checkpoint_path={folder}",
        "trainer.logger=[file]",
        *where,
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (folder / "experiment_log.jsonl").read_text().splitlines()]
    rewards = [r["reward/overall"] for r in rows]
    steady = rows[5:]  # past the first steps' start-up costs
    out = {
        "setting": setting,
        "placement": placement,
        "staleness": staleness,
        "wall_s": round(wall, 1),
        "train_s": round(sum(r["timing_s/step"] for r in rows), 2),
        # means over the steps past the fifth: what the runs' wall time is made of
        "s_per_step": round(statistics.mean(r["timing_s/step"] for r in steady), 3),
        "gen_s": round(statistics.mean(r["timing_s/gen"] for r in steady), 3),
        "reward_s": round(statistics.mean(r["timing_s/reward"] for r in steady), 3),
        "update_s": round(statistics.mean(r["timing_s/update_actor"] for r in steady), 3),
        "median_s_per_step": round(statistics.median(r["timing_s/step"] for r in steady), 3),
        "first5": round(statistics.mean(rewards[:5]), 3),
        "last5": round(statistics.mean(rewards[-5:]), 3),
        "curve": [round(statistics.mean(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)],
        "response_len": round(statistics.mean(r["response_length/mean"] for r in rows), 2),
        "response_len_max": max(r["response_length/max"] for r in rows),
    }
    if staleness:
        out |= {
            "staleness_mean": round(statistics.mean(r["async/staleness_mean"] for r in rows), 3),
            "resumed": round(statistics.mean(r["async/resumed_fraction"] for r in rows), 3),
            "engine_calls": round(statistics.mean(r["async/engine_calls"] for r in rows), 2),
            "scored_early": round(statistics.mean(r["async/scored_early"] for r in rows), 3),
            # seconds a step the rollout worker generated beside the training (0 colocated: the sides take turns)
            "overlap_s": round(statistics.mean(r.get("async/overlap_s", 0.0) for r in steady), 3),
        }
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| placement | max_staleness | wall (s) | s/step (median) | gen s/step | reward s/step | update s/step "
        "| reward first 5 -> last 5 | reward per 10 steps | trained tokens' mean staleness | rows resumed "
        "| generated beside training (s/step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting in dict.fromkeys(r["setting"] for r in results):
        runs = [r for r in results if r["setting"] == setting]
        s = runs[0]["staleness"]

        def mean(key: str, runs: list[dict] = runs) -> float:
            return statistics.mean(r[key] for r in runs)

        curve = " ".join(f"{statistics.mean(c):.2f}" for c in zip(*(r["curve"] for r in runs)))
        lines.append(
            f"| {runs[0]['placement']} | {s} | {mean('wall_s'):.1f} | {mean('s_per_step'):.3f} ({mean('median_s_per_step'):.3f}) "
            f"| {mean('gen_s'):.3f} | {mean('reward_s'):.3f} "
            f"| {mean('update_s'):.3f} | {mean('first5'):.3f} -> {mean('last5'):.3f} | {curve} "
            f"| {mean('staleness_mean') if s else 0:.2f} | {mean('resumed') if s else 0:.2f} "
            f"| {mean('overlap_s') if s else 0:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["colocated:0", "colocated:1", "colocated:2", "separate:0", "separate:1", "separate:2"],
        help="placement:max_staleness pairs",
    )
    parser.add_argument("--staleness", type=int, nargs="+", help="colocated runs only, at these max_staleness")
    parser.add_argument("--reward-seconds", type=float, default=0.05)
    parser.add_argument("--workdir", type=Path, default=Path("bench_async"))
    parser.add_argument("extra", nargs="*", help="more config overrides for every run (key=value)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    reward = args.workdir / "slow_digits.py"
    digits = str(REPO / "reward_functions" / "digits.py")
    reward.write_text(SLOW_REWARD.format(digits=digits, seconds=args.reward_seconds))
    if args.staleness is not None:  # the older form of the command (docs/benchmarks.md): colocated only
        args.settings = [f"colocated:{s}" for s in args.staleness]
    for setting in args.settings:
        if setting.split(":")[0] not in ("colocated", "separate") or not setting.partition(":")[2].isdigit():
            parser.error(f"--settings {setting}: write placement:max_staleness, e.g. separate:1")
    order = [s for r in range(args.repeats) for s in (args.settings if r % 2 == 0 else args.settings[::-1])]
    results = []
    for i, setting in enumerate(order):
        result = run(setting, args.steps, reward.resolve(), (args.workdir / f"run{i}").resolve(), args.extra)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(table(results))


if __name__ == "__main__":
    main()
