"""An in-process reward function (num_workers=0) that calls os._exit or sys.exit cannot end the run: the call is
that sample's error, counted and logged once naming the function (issue 36). Run in a child process, so that a
failing guard ends the child, not pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


REWARD = """
import os, sys

def compute_score(sample):
    if sample["kind"] == "os_exit":
        os._exit(3)
    if sample["kind"] == "sys_exit":
        sys.exit(4)
    return 1.0
"""

DRIVER = """
import json, logging, os, sys, threading
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from easyrl.config.worker import RewardConfig
from easyrl.rewards import RewardManager

kinds = ["ok", "os_exit", "ok", "sys_exit"]
cfg = RewardConfig(
    reward_function=sys.argv[1], reward_type="sequential", num_workers=0, timeout_s=60.0, fallback_score=-1.0,
    max_error_ratio=1.0,
)
with RewardManager(cfg) as manager:
    scores, metrics = manager.score([{"kind": k, "response": "r", "ground_truth": "1"} for k in kinds])
print(json.dumps({"scores": [s["overall"] for s in scores], "errors": metrics["reward/errors"]}))
sys.stdout.flush()
os._exit(0)  # outside a reward call the real os._exit still works
"""


def test_exit_in_an_in_process_reward_is_that_calls_error(tmp_path: Path) -> None:
    reward = tmp_path / "quits.py"
    reward.write_text(REWARD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, f"{reward}:compute_score"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, f"the reward ended the process (rc {proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"scores": [1.0, -1.0, 1.0, -1.0], "errors": 2}
    line = next(x for x in proc.stderr.splitlines() if "raised" in x)
    assert "quits.py:compute_score" in line and "called os._exit(3), which would end the training process" in line
