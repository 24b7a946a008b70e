"""Reward failures during validation are counted (`val/reward_errors`), as they are in training."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_e2e import ray_session, run  # noqa: F401  (module-scoped Ray fixture)


pytestmark = pytest.mark.slow

FLAKY_REWARD = """
REWARD_TYPE = "sequential"

def main(x):
    if x["ground_truth"].endswith("0"):
        raise ValueError("judge unavailable")
    return {"overall": 1.0}
"""


def test_val_reward_errors_are_counted(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    edits = {
        "data.val_files": digits_data["val"],  # 8 rows; the answers 000 and 010 end in 0
        "worker.reward.reward_function": f"{reward}:main",
        "trainer.val_only": True,
    }
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    val = rows[-1]
    assert val["val/reward_errors"] == 2.0
    assert val["val/reward_score"] == pytest.approx(6 / 8)
