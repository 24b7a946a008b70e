"""Validation: reward failures are counted (`val/reward_errors`), as they are in training; sampled validation
reports per-prompt metrics; validation asks the engines for no log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

FLAKY_REWARD = """
REWARD_TYPE = "sequential"

def main(x):
    if x["ground_truth"].endswith("0"):
        raise ValueError("judge unavailable")
    return {"overall": 1.0}
"""


@pytest.mark.extended  # make test: test_validation_asks_the_engines_for_no_log_probs's validation (below) checks it
def test_val_reward_errors_are_counted(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    """A `val_only` run, greedy (n = 1): the errors are counted. `make test` has both halves on shorter paths: the
    same counts on the greedy validation before `test_validation_asks_the_engines_for_no_log_probs`'s training step,
    and a `val_only` run in `test_sampled_validation_reports_mean_best_and_pass_at_n`."""
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


# The HF engine, recording whether each call asked for log-probs (a line per call in the file named below).
RECORDING_ENGINE = """
from easyrl.rollout import EngineContext, register_engine
from easyrl.rollout.hf import HFRolloutEngine


class RecordingHFEngine(HFRolloutEngine):
    def generate(self, prompts, params):
        with open({path!r}, "a") as f:
            f.write(f"{{params.logprobs}}\\n")
        return super().generate(prompts, params)


@register_engine("recording_hf", override=True)
def build(ctx: EngineContext):
    model = ctx.spec.model
    return RecordingHFEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )
"""


def test_validation_asks_the_engines_for_no_log_probs(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    """Training asks for them (the engine-vs-actor figures: `rollout/token_prob_error`); validation, which nothing
    compares with the trainer, does not. The same run's greedy validation counts the reward's failures (one run
    shows both: `test_val_reward_errors_are_counted`'s check)."""
    calls = tmp_path / "calls.txt"
    engine = tmp_path / "recording_engine.py"
    engine.write_text(RECORDING_ENGINE.format(path=str(calls)))
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    edits = {
        "data.val_files": digits_data["val"],  # 8 rows; the answers 000 and 010 end in 0
        "worker.reward.reward_function": f"{reward}:main",
        "algorithm.user_modules": [str(engine)],
        "worker.rollout.name": "recording_hf",
        "trainer.val_before_train": True,
    }
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    (val,) = [r for r in rows if "val/reward_score" in r]
    assert val["step"] == 0 and val["val/reward_errors"] == 2.0
    assert val["val/reward_score"] == pytest.approx(6 / 8)
    assert "rollout/token_prob_error" in rows[-1]  # the training step's engine log-probs were compared
    asked = calls.read_text().split()
    # the validation calls ("False"), then the training step's ("True")
    assert set(asked) == {"False", "True"} and asked == sorted(asked), asked
