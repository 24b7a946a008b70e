"""Resume reproduces the uninterrupted run bit for bit (on CPU), across an epoch boundary too."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from easyrl.config import ConfigError
from tests.trainer.test_e2e import _VOLATILE, run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows]


def test_resume_equals_uninterrupted_across_epoch_boundary(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    # 64 rows / 16 prompts per step = 4 steps per epoch: resuming from step 3 crosses into epoch 2.
    edits = {
        "data.rollout_batch_size": 16,
        "worker.actor.global_batch_size": 8,
        "trainer.save_freq": 3,
        "trainer.total_epochs": 2,
        "worker.actor.micro_batch_size_per_device_for_update": 4,
    }
    full, _, _ = run(tmp_path / "full", tiny_model_dir, digits_data, edits, steps=6)
    # The uninterrupted run's own step-3 checkpoint, as a run killed after it would have left it (a run of its own
    # stopped at step 3 would repeat steps 1-3 to make the same files), resumed in a fresh folder.
    checkpoint = tmp_path / "full" / "run" / "global_step_3"
    resumed, _, _ = run(
        tmp_path / "resumed",
        tiny_model_dir,
        digits_data,
        {**edits, "trainer.load_checkpoint_path": str(checkpoint)},
        6,
    )
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert _stable(resumed) == _stable(full[3:]), "the resumed run left the uninterrupted curve"
    tracker = (tmp_path / "resumed" / "run" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "6"


def test_explicit_missing_checkpoint_is_an_error(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    """Found by the config validation, before any worker starts."""
    with pytest.raises(ConfigError, match=r"trainer.load_checkpoint_path: .*global_step_99 does not exist"):
        run(
            tmp_path,
            tiny_model_dir,
            digits_data,
            {"trainer.load_checkpoint_path": str(tmp_path / "global_step_99")},
            steps=1,
        )


def test_log_is_appended_not_rewritten_on_resume(
    tmp_path: Path, tiny_model_dir, digits_data, caplog: pytest.LogCaptureFixture
) -> None:
    """The log and the config record keep the whole history; a resume names what changed in the config and refuses
    a changed model (issue 36: a new model_path or learning rate was taken silently and the record overwritten)."""
    run(tmp_path, tiny_model_dir, digits_data, {}, steps=1)
    assert json.loads((tmp_path / "run" / "global_step_1" / "experiment_config.json").read_text())["trainer"]
    with caplog.at_level(logging.INFO, logger="easyrl"):
        rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, {"worker.actor.optim.lr": 2e-3}, steps=2)
    assert [r["step"] for r in rows] == [1, 2]
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "changed training" in r.message
    ]
    assert len(warned) == 1 and "worker.actor.optim.lr: 0.001 -> 0.002" in warned[0], warned
    assert "trainer.max_steps: 1 -> 2" in caplog.text and "trainer.max_steps" not in warned[0]
    record = tmp_path / "run" / "experiment_config.json"
    assert json.loads(record.read_text())["trainer"]["max_steps"] == 1  # the original record is kept
    resumed = json.loads((tmp_path / "run" / "experiment_config.resume1.json").read_text())
    assert resumed["trainer"]["max_steps"] == 2 and resumed["worker"]["actor"]["optim"]["lr"] == 2e-3

    other_model = shutil.copytree(tiny_model_dir, tmp_path / "other_model")
    edits = {"worker.actor.optim.lr": 2e-3, "worker.actor.model.model_path": str(other_model)}
    with pytest.raises(
        ConfigError,
        match=r"^worker\.actor\.model\.model_path: the model changed since .*"
        r"global_step_2.*allow_model_change_on_resume=true",
    ):
        run(tmp_path, tiny_model_dir, digits_data, edits, steps=3)
    assert not (tmp_path / "run" / "experiment_config.resume2.json").exists()


def test_a_finished_run_resumes_to_nothing_and_a_fresh_start_sets_the_old_log_aside(
    tmp_path: Path, tiny_model_dir, digits_data, caplog: pytest.LogCaptureFixture
) -> None:
    """Running a finished run's command again adds nothing to its log (no second validation of the last step); a
    run that starts over at step 1 in the folder (no checkpoint left) keeps the earlier log apart, not mixed in."""
    edits = {"data.val_files": digits_data["val"], "trainer.val_before_train": True}
    first, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    assert [r["step"] for r in first] == [0, 1]
    with caplog.at_level(logging.INFO, logger="easyrl"):
        again, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    assert again == first  # the log as it was: nothing trained, nothing validated
    assert "already trained to step 1 of 1" in caplog.text
    assert "starting Ray" not in caplog.text  # and nothing started for it
    for folder in (tmp_path / "run").glob("global_step_*"):
        shutil.rmtree(folder)
    fresh, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    assert [r["step"] for r in fresh] == [0, 1]  # this run's rows only
    earlier = (tmp_path / "run" / "experiment_log.before1.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in earlier] == first
