"""Config values that are well-typed but impossible: each refused at load time as one line naming the key
(issue 36: YAML alias bombs, non-finite numbers, run names leaving the checkpoint root, an absurd rollout.n, a
resume onto another world size)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, load_config
from easyrl.config.loader import MAX_CONFIG_NODES, expanded_size
from tests.checkpoint.test_ckpt_safety import checkpoint  # noqa: F401  (module-scoped fixture: a real checkpoint)
from tests.conftest import base_config, write_config


def _laughs(levels: int) -> str:
    """The 'billion laughs' YAML: each level lists the previous one 9 times, 9**levels strings in under 1 KB."""
    lines = ["trainer:", '  l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"  l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_laughs(8))  # 9**9 = 387M strings once copied: minutes and GBs on the old code
    assert bomb.stat().st_size < 1024
    with pytest.raises(ConfigError, match=r"bomb\.yaml expands to more than 1,000,000 values through YAML aliases"):
        load_config(bomb)
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("trainer:\n  a: &a [1, *a]\n")  # a list holding itself: unbounded
    with pytest.raises(ConfigError, match=r"cycle\.yaml expands to more than"):
        load_config(cycle)


def test_expanded_size_counts_aliases_as_copies() -> None:
    leaf = ["a", "b"]  # 3 values
    assert expanded_size({"x": leaf, "y": leaf}, limit=100) == 1 + 3 + 3
    assert expanded_size({"x": [leaf] * 50}, limit=100) > 100  # stopped early, not measured exactly
    assert expanded_size({"x": list(range(10))}, limit=MAX_CONFIG_NODES) == 12


@pytest.fixture
def conf(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> dict[str, Any]:
    return base_config(tiny_model_dir, digits_data, tmp_path / "run")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("worker.rollout.temperature=nan", "worker.rollout.temperature"),
        ("worker.rollout.temperature=inf", "worker.rollout.temperature"),
        ("worker.actor.optim.lr=-inf", "worker.actor.optim.lr"),
        ("algorithm.kl_coef=.nan", "algorithm.kl_coef"),
        ("+worker.reward.reward_function_kwargs.scale=.inf", "worker.reward.reward_function_kwargs.scale"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(
    tmp_path: Path, conf: dict[str, Any], override: str, key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path / "c.yaml", conf), [override])
    assert info.value.key == key and "must be finite" in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["../..", "..", "a/../../b", "/tmp/elsewhere", "a\\b", ""])
def test_run_names_cannot_leave_the_checkpoint_root(tmp_path: Path, conf: dict[str, Any], name: str) -> None:
    del conf["trainer"]["save_checkpoint_path"]  # the default checkpoints/<project>/<experiment> is what moves
    path = write_config(tmp_path / "c.yaml", conf)
    with pytest.raises(ConfigError, match=r"trainer\.experiment_name.*not a plain name"):
        load_config(path, [f"trainer.experiment_name='{name}'"])
    with pytest.raises(ConfigError, match=r"trainer\.project_name.*not a plain name"):
        load_config(path, [f"trainer.project_name='{name}'"])
    assert load_config(path, ["trainer.experiment_name=run-2.lr_1e-6"]).trainer.save_checkpoint_path.endswith(
        "checkpoints/easyrl/run-2.lr_1e-6"
    )


def test_absurd_rollout_n_is_refused_with_the_arithmetic(tmp_path: Path, conf: dict[str, Any]) -> None:
    path = write_config(tmp_path / "c.yaml", conf)
    with pytest.raises(ConfigError, match=r"worker.rollout.n: 1000000000 responses .* lower worker.rollout.n"):
        load_config(path, ["worker.rollout.n=1000000000"])
    assert load_config(path, ["worker.rollout.n=512"]).worker.rollout.n == 512  # large but real (pass@k studies)


def test_resume_onto_another_world_size_is_refused_at_load(
    tmp_path: Path,
    conf: dict[str, Any],
    checkpoint: dict[str, Any],  # noqa: F811
) -> None:
    """The checkpoint was saved by 1 worker; this config has 2: found before any worker starts, both for an
    explicit load_checkpoint_path and for the newest checkpoint under the run folder (find_last_checkpoint)."""
    run = tmp_path / "run"
    shutil.copytree(checkpoint["folder"], run / "global_step_1")
    path = write_config(tmp_path / "c.yaml", conf)
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node: checkpoint .*global_step_1 was saved by 1 "):
        load_config(path)
    explicit = f"trainer.load_checkpoint_path={run / 'global_step_1'}"
    with pytest.raises(ConfigError, match=r"trainer.load_checkpoint_path: .* saved by 1 workers but this run has 2"):
        load_config(path, [explicit, "trainer.find_last_checkpoint=false"])
    assert load_config(path, [explicit, "trainer.n_gpus_per_node=1", "worker.actor.global_batch_size=2"])
