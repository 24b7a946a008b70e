"""Wall time of one reward stage in which some calls hang, with the settings of the issue that measured it.

Usage:
    python scripts/bench_hung_rewards.py [--timeout-s 5] [--samples 128] [--hung 48 128] [--workers 2]

A sequential reward function sleeps for an hour on the hung samples and answers at once on the others. For each
count of hung samples it times `RewardManager.score` over one batch, with the default `max_error_ratio` (0.5: all
hung ends in `RewardError`) and with `max_error_ratio=1.0` (the stage has to wait out its deadline), and prints
one line per case. The bound is `timeout_s` plus a small margin, whatever the number of hung calls.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REWARD = """
import time
REWARD_TYPE = "sequential"

def main(x):
    if x["hang"]:
        time.sleep(3600)
    return {"overall": 1.0}
"""


def measure(spec: str, samples: int, hung: int, timeout_s: float, workers: int, ratio: float) -> tuple[float, str]:
    """(seconds, outcome) of one reward stage with `hung` of `samples` calls hanging."""
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardError, RewardManager

    cfg = RewardConfig(reward_function=spec, num_workers=workers, timeout_s=timeout_s, max_error_ratio=ratio)
    # `hung` samples spread evenly over the batch (every one when hung == samples)
    inputs = [{"i": i, "hang": (i * hung) // samples != ((i + 1) * hung) // samples} for i in range(samples)]
    with RewardManager(cfg) as manager:
        manager.score([{"i": -1, "hang": False}])  # workers up and warm before the clock starts
        start = time.monotonic()
        try:
            _, metrics = manager.score(inputs)
            outcome = f"{int(metrics['reward/timeouts'])} timeouts"
        except RewardError:
            outcome = "RewardError"
        return time.monotonic() - start, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--hung", type=int, nargs="+", default=[48, 128])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hang.py"
        path.write_text(REWARD)
        for hung in args.hung:
            for ratio in (0.5, 1.0):
                seconds, outcome = measure(f"{path}:main", args.samples, hung, args.timeout_s, args.workers, ratio)
                print(
                    f"hung {hung}/{args.samples}  timeout_s={args.timeout_s:g}  num_workers={args.workers}  "
                    f"max_error_ratio={ratio:g}: reward stage {seconds:.1f} s ({outcome})"
                )


if __name__ == "__main__":
    main()
