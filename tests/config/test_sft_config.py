"""An SFT config (one with an `sft` section): validated for what `easyrl sft` reads, refused by `easyrl train`, and
each mistake named by its key with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, load_config
from easyrl.config.loader import config_task
from tests.conftest import write_config


def long_context_model(tmp_path: Path) -> str:
    """A tiny model whose context holds the default sft.max_length (2048)."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path / "long", num_heads=2, num_kv_heads=1, max_position_embeddings=4096)


def _sft(tmp_path: Path, model: str, data: dict[str, str], **sft: Any) -> dict[str, Any]:
    """An SFT config with no reward function, rollout or RL batch sizes: none of them is read."""
    return {
        "data": {"train_files": data["train"], "val_files": data["val"]},
        "sft": {"max_length": 128, **sft},
        "worker": {
            "actor": {
                "global_batch_size": 8,
                "micro_batch_size_per_device_for_update": 2,
                "dynamic_batching": False,
                "model": {"model_path": model},
            }
        },
        "trainer": {"n_gpus_per_node": 2, "device": "cpu", "save_checkpoint_path": str(tmp_path / "run")},
    }


def test_an_sft_config_loads_as_sft_and_is_refused_by_train(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    path = write_config(tmp_path / "sft.yaml", _sft(tmp_path, tiny_model_dir, digits_data))
    assert config_task(path) == "sft" and config_task(path, ["sft.max_length=64"]) == "sft"
    cfg = load_config(path, task="sft")
    assert cfg.sft.max_length == 128 and cfg.worker.reward.reward_function is None
    with pytest.raises(ConfigError, match=r"^sft: this config has an sft section: .*run `easyrl sft CONFIG`"):
        load_config(path)


def test_an_rl_config_without_reward_function_points_at_sft(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    conf = _sft(tmp_path, tiny_model_dir, digits_data)
    del conf["sft"]
    conf["worker"]["actor"]["model"]["model_path"] = long_context_model(tmp_path)
    path = write_config(tmp_path / "rl.yaml", conf)
    assert config_task(path) == "rl"
    cfg = load_config(path, ["trainer.experiment_name=x"], task="sft")  # `easyrl sft` takes it, with the defaults
    assert cfg.sft.messages_key == "messages" and cfg.sft.max_length == 2048
    with pytest.raises(ConfigError, match=r"worker.reward.reward_function: is required: .*`sft:` section"):
        load_config(path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"worker.actor.global_batch_size": 7}, r"worker.actor.global_batch_size: 7 rows .* over 2 data-parallel"),
        (
            {"worker.actor.micro_batch_size_per_device_for_update": 3},
            r"micro_batch_size_per_device_for_update: 3 must divide the 4 rows each worker trains",
        ),
        ({"sft.overlong": "truncate"}, r"sft.overlong: 'truncate' is not allowed; choose one of: drop, error"),
        ({"sft.max_length": 4096}, r"sft.max_length: 4096 exceeds the model's context \(1024\)"),
        ({"sft.messages_key": ""}, r"sft.messages_key: is empty"),
        ({"sft.max_lenght": 10}, r"sft.max_lenght: unknown key. Did you mean sft.max_length\?"),
        ({"worker.actor.ppo_epochs": 2}, r"worker.actor.ppo_epochs: is an RL key"),
    ],
)
def test_sft_mistakes_name_the_key(tmp_path: Path, tiny_model_dir, digits_data, edit: dict, match: str) -> None:
    conf = _sft(tmp_path, tiny_model_dir, digits_data)
    for dotted, value in edit.items():
        *parents, leaf = dotted.split(".")
        node = conf
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    with pytest.raises(ConfigError, match=match):
        load_config(write_config(tmp_path / "bad.yaml", conf), task="sft")


def test_chat_template_kwargs_is_a_free_form_mapping(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    path = write_config(tmp_path / "sft.yaml", _sft(tmp_path, tiny_model_dir, digits_data))
    cfg = load_config(path, ["+data.chat_template_kwargs.enable_thinking=false"], task="sft")
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
