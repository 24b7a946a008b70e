"""`ulysses_size`: bad settings stop with one line naming the key; good ones give the data-parallel batch arithmetic
(per-rank mini-batches over workers / ulysses_size, token budgets of the whole group) to the role specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, load_config
from tests.conftest import base_config, write_config


@pytest.fixture
def conf(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> dict[str, Any]:
    return base_config(tiny_model_dir, digits_data, tmp_path / "run")  # 2 workers, a model with 2 attention heads


PACKED = "worker.actor.padding_free=true"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["worker.actor.ulysses_size=2"], "worker.actor.ulysses_size: 2 needs worker.actor.padding_free=true"),
        (
            [PACKED, "worker.actor.ulysses_size=3"],
            r"worker.actor.ulysses_size: 3 must divide the number of workers \(2\)",
        ),
        (["worker.critic.ulysses_size=0"], "worker.critic.ulysses_size: must be a positive integer, got 0"),
        (
            [PACKED, "trainer.n_gpus_per_node=4", "worker.actor.ulysses_size=4"],
            r"worker.actor.ulysses_size: 4 must divide the model's attention heads \(2\)",
        ),
        (
            [PACKED, "worker.actor.ulysses_size=2", "worker.actor.micro_batch_size_per_device_for_update=3"],
            r"worker.actor.micro_batch_size_per_device_for_update: 3 must divide the per-worker mini-batch of 4 samples "
            r"\(global_batch_size \* n / 1 workers \(data-parallel groups: workers / sequence-parallel group 2\)\)",
        ),
        (["worker.actor.ring_size=0"], "worker.actor.ring_size: must be a positive integer, got 0"),
        (["worker.actor.ring_size=2"], "worker.actor.ring_size: 2 needs worker.actor.padding_free=true"),
        (
            [PACKED, "worker.actor.ulysses_size=2", "worker.actor.ring_size=2"],
            r"worker.actor.ring_size: ulysses_size x ring_size = 2 x 2 must divide the number of workers \(2\)",
        ),
    ],
)
def test_bad_sequence_parallel_settings_stop_with_one_line(
    tmp_path: Path, conf: dict[str, Any], overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{message}") as info:
        load_config(write_config(tmp_path / "c.yaml", conf), overrides)
    assert "\n" not in str(info.value)


def test_role_specs_divide_the_batch_over_data_parallel_groups(tmp_path: Path, conf: dict[str, Any]) -> None:
    from easyrl.check import plan_lines
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import build_role_specs

    path = write_config(tmp_path / "c.yaml", conf)
    overrides = [PACKED, "worker.actor.dynamic_batching=true", "worker.actor.max_token_len_per_gpu=100"]
    plain_cfg = load_config(path, [*overrides, "algorithm.disable_kl=false"])
    plain = build_role_specs(plain_cfg, plan_of(plain_cfg), 2, 2)
    cfg = load_config(path, [*overrides, "worker.actor.ulysses_size=2", "algorithm.disable_kl=false"])
    split = build_role_specs(cfg, plan_of(cfg), 2, 2)
    assert (plain.actor.update.mini_batch_size, split.actor.update.mini_batch_size) == (2, 4)
    assert (plain.actor.model.forward.max_token_len, split.actor.model.forward.max_token_len) == (100, 200)
    assert split.actor.model.forward.ulysses_size == 2
    assert split.ref is not None and split.ref.model.forward.ulysses_size == 2  # the reference follows the actor
    assert any("sequence parallel 2 (1 data-parallel groups)" in line for line in plan_lines(cfg))


def test_ring_size_joins_the_sequence_parallel_group(tmp_path: Path, conf: dict[str, Any]) -> None:
    """ring_size 2 on 2 workers: one data-parallel group of ulysses 1 x ring 2, whose token budget is the group's."""
    from easyrl.check import plan_lines
    from easyrl.trainer.plan import data_parallel_size, plan_of
    from easyrl.trainer.role_specs import build_role_specs

    path = write_config(tmp_path / "c.yaml", conf)
    overrides = [
        PACKED,
        "worker.actor.dynamic_batching=true",
        "worker.actor.max_token_len_per_gpu=100",
        "algorithm.disable_kl=false",
    ]
    cfg = load_config(path, [*overrides, "worker.actor.ring_size=2"])
    specs = build_role_specs(cfg, plan_of(cfg), 2, 2)
    assert data_parallel_size(cfg) == 1
    assert specs.actor.update.mini_batch_size == 4
    assert specs.actor.model.forward.max_token_len == 200
    assert (specs.actor.model.forward.ulysses_size, specs.actor.model.forward.ring_size) == (1, 2)
    assert specs.ref is not None and specs.ref.model.forward.ring_size == 2  # the reference follows the actor
    assert any("sequence parallel 1 x ring 2 (1 data-parallel groups)" in line for line in plan_lines(cfg))


def test_vision_language_models_count_their_language_model_heads(tmp_path: Path, conf: dict[str, Any]) -> None:
    """A VL model's attention heads are its text model's (the vision tower is not split)."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    vl = build_tiny_vl_checkpoint(tmp_path / "vl", arch="qwen2_5_vl")
    heads = json.loads((Path(vl) / "config.json").read_text())["text_config"]["num_attention_heads"]
    path = write_config(tmp_path / "c.yaml", conf)
    base = [PACKED, f"worker.actor.model.model_path={vl}"]
    assert load_config(path, [*base, "worker.actor.ulysses_size=2"]).worker.actor.ulysses_size == 2
    workers = 2 * heads  # rollout prompts and the update batch must still divide over that many
    too_many = [*base, f"trainer.n_gpus_per_node={workers}", f"worker.actor.ulysses_size={workers}"]
    too_many += [f"data.rollout_batch_size={workers}", f"worker.actor.global_batch_size={workers}"]
    with pytest.raises(ConfigError, match=rf"must divide the model's attention heads \({heads}\)"):
        load_config(path, too_many)
