"""Comparing a checkpoint's config with the current one on resume: each kind of change, by hand-made configs."""

from __future__ import annotations

import copy

import pytest

from easyrl.config import ConfigError
from easyrl.config.resume_diff import config_changes, resume_config_report


SAVED = {
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"max_steps": 10, "logger": ["file"]},
    "worker": {
        "actor": {
            "optim": {"lr": 1e-6},
            "model": {"model_path": "/m/a", "lora": {"rank": 0, "dropout": 0.0}, "override_config": {}},
        },
        "reward": {"reward_function_kwargs": {"api_key": "***"}},
    },
}


def test_no_change_says_nothing() -> None:
    assert resume_config_report(SAVED, copy.deepcopy(SAVED), "ck", False) == ([], [])


def test_run_settings_are_a_note_and_training_changes_a_warning_naming_each_key() -> None:
    current = copy.deepcopy(SAVED)
    current["trainer"].update(max_steps=20, logger=["file", "tensorboard"])
    current["algorithm"]["adv_estimator"] = "gae"
    current["worker"]["actor"]["optim"]["lr"] = 2e-6
    info, warnings = resume_config_report(SAVED, current, "run/global_step_3", False)
    assert info == [
        "resuming run/global_step_3 with changed run settings: trainer.logger: ['file'] -> ['file', 'tensorboard']; "
        "trainer.max_steps: 10 -> 20"
    ]
    assert len(warnings) == 1
    assert "algorithm.adv_estimator: 'grpo' -> 'gae'" in warnings[0]
    assert "worker.actor.optim.lr: 1e-06 -> 2e-06" in warnings[0]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("worker", "actor", "model", "model_path"), "/m/b"),
        (("worker", "actor", "model", "lora", "rank"), 8),
        (("worker", "actor", "model", "override_config"), {"rope_theta": 5.0}),
    ],
)
def test_a_changed_model_is_refused_unless_allowed(path: tuple[str, ...], value: object) -> None:
    current = copy.deepcopy(SAVED)
    node = current
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    key = ".".join(path)
    with pytest.raises(ConfigError, match=r"allow_model_change_on_resume=true") as info:
        resume_config_report(SAVED, current, "ck", False)
    assert info.value.key.startswith(key)
    _, warnings = resume_config_report(SAVED, current, "ck", True)
    assert len(warnings) == 1 and key in warnings[0]


def test_lora_dropout_is_not_a_model_change_and_keys_added_or_removed_count() -> None:
    current = copy.deepcopy(SAVED)
    current["worker"]["actor"]["model"]["lora"]["dropout"] = 0.1
    current["worker"]["reward"]["reward_function_kwargs"]["judge"] = "gpt"
    changes = config_changes(SAVED, current)
    assert changes == {
        "worker.actor.model.lora.dropout": (0.0, 0.1, "training"),
        "worker.reward.reward_function_kwargs.judge": ("(absent)", "gpt", "training"),
    }


def test_run_management_keys_are_real_config_keys() -> None:
    """The list of harmless keys cannot go stale silently when a key is renamed."""
    from pathlib import Path

    from easyrl.config.resume_diff import _RUN_MANAGEMENT

    keys = set((Path(__file__).with_name("config_keys.txt")).read_text().split())
    assert keys >= _RUN_MANAGEMENT, sorted(_RUN_MANAGEMENT - keys)


def test_a_key_newer_than_the_checkpoint_at_its_default_is_no_change() -> None:
    """A checkpoint saved before a key existed: the key at its default is what it trained with; set otherwise, it is
    a change like any other."""
    current = copy.deepcopy(SAVED)
    current["algorithm"]["new_feature"] = {"on": False}
    defaults = {"algorithm": {"new_feature": {"on": False}}}
    assert resume_config_report(SAVED, current, "ck", False, defaults) == ([], [])
    current["algorithm"]["new_feature"]["on"] = True
    _, warnings = resume_config_report(SAVED, current, "ck", False, defaults)
    assert "algorithm.new_feature.on: '(absent)' -> True" in warnings[0]
