"""Features under `trainer.backend: inline` give what they give on Ray, bit for bit (one worker per role, CPU): LoRA
(the actor serving its base as the reference), SFT, the multi-turn tool demo, and its carry-over schedule at one
step of staleness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.trainer.test_e2e import _VOLATILE, run
from tests.trainer.test_sft_e2e import _train as sft_train
from tests.trainer.test_sft_e2e import sft_data  # noqa: F401  (the SFT conversations fixture)


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

ONE_WORKER = {"trainer.n_gpus_per_node": 1}
# The carry-over loop's wall-time figures (who waited how long for whom): measured, not computed.
_WALL_TIME = ("async/engine_wait_s", "async/trainer_wait_s", "async/engine_idle_ratio", "async/trainer_idle_ratio")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE) and k not in _WALL_TIME} for r in rows]


def test_lora_is_bit_identical_inline_and_on_ray(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    edits = {
        **ONE_WORKER,
        "worker.actor.model.lora.rank": 4,
        "worker.actor.model.lora.alpha": 8,
        "algorithm.disable_kl": False,
        "algorithm.use_kl_loss": True,
        "algorithm.kl_coef": 0.1,
        "worker.actor.optim.lr": 3e-2,
    }
    on_ray, _, _ = run(tmp_path / "ray", tiny_model_dir, digits_data, {**edits, "trainer.backend": "ray"}, steps=3)
    inline, _, _ = run(tmp_path / "inline", tiny_model_dir, digits_data, {**edits, "trainer.backend": "inline"}, 3)
    assert "actor/kl_loss" in inline[-1]  # the LoRA actor served the reference
    assert _stable(inline) == _stable(on_ray)


def test_sft_is_bit_identical_inline_and_on_ray(tmp_path: Path, tiny_model_dir, sft_data) -> None:  # noqa: F811
    rows, _, ray_after = sft_train(
        tmp_path / "ray", tiny_model_dir, sft_data, {**ONE_WORKER, "trainer.backend": "ray"}
    )
    inline, _, inline_after = sft_train(
        tmp_path / "inline", tiny_model_dir, sft_data, {**ONE_WORKER, "trainer.backend": "inline"}
    )
    assert [r["step"] for r in inline if "train/loss" in r] == [1, 2, 3, 4]
    assert _stable(inline) == _stable(rows)
    assert all(inline_after[name].equal(ray_after[name]) for name in ray_after)


def _tools(tmp: Path, extra: list[str]) -> list[dict[str, Any]]:
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    overrides = [
        "trainer.max_steps=2",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={tmp / 'run'}",
        "trainer.ray_num_cpus=4",
        "data.rollout_batch_size=4",
        "worker.actor.global_batch_size=4",
        "worker.rollout.n=4",
        *extra,
    ]
    trainer = Trainer(*load_config_and_secrets(REPO / "configs" / "demo_tools.yaml", overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [json.loads(line) for line in (tmp / "run" / "experiment_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "schedule",
    [[], ["trainer.max_staleness=1", "worker.rollout.chunk_tokens=20"]],
    ids=["synchronous", "carry_over_s1"],
)
def test_the_tool_demo_is_bit_identical_inline_and_on_ray(
    tmp_path: Path, schedule: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the demo's paths are the repository's
    on_ray = _tools(tmp_path / "ray", [*schedule, "trainer.backend=ray"])
    inline = _tools(tmp_path / "inline", [*schedule, "trainer.backend=inline"])
    assert any(r.get("multi_turn/tool_call_rate", 0) > 0 for r in inline)  # tools were called
    assert all(("async/groups_carried" in r) == bool(schedule) for r in inline)  # the schedule asked for ran
    assert _stable(inline) == _stable(on_ray)
