"""Validation: reward failures are counted (`val/reward_errors`), as they are in training; sampled validation
reports per-prompt metrics."""

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


def test_sampled_validation_reports_mean_best_and_pass_at_n(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    """n=2 samples per prompt at temperature 1: every sample is scored, and the per-prompt metrics are logged (the
    two prompts whose answers end in 0 fail at both samples; the others score a full 1.0)."""
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    edits = {
        "data.val_files": digits_data["val"],
        "worker.reward.reward_function": f"{reward}:main",
        "worker.rollout.val_override_config": {"temperature": 1.0, "n": 2},
        "trainer.val_only": True,
    }
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    val = rows[-1]
    assert val["val/reward_errors"] == 4.0  # 2 prompts x 2 samples
    for key in ("val/reward_score", "val/reward/mean@2", "val/reward/best@2", "val/pass@2"):
        assert val[key] == pytest.approx(6 / 8), key
