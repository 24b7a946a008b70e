"""The tool demo through the one trainer (Ray, 2 FSDP2 CPU workers, the HF engine, the multi-turn loop): reward and
tool-call rate both rise, and every multi-turn metric is logged each step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easyrl.config import load_config_and_secrets
from tests.conftest import REPO


pytestmark = pytest.mark.slow
STEPS = 12


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_the_tool_demo_learns_to_call_its_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from easyrl.distributed import init_ray
    from easyrl.trainer.trainer import Trainer

    monkeypatch.chdir(REPO)  # the demo's paths are relative to the repository root
    init_ray(num_cpus=4)
    overrides = [
        f"trainer.max_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={tmp_path / 'run'}",
        "trainer.ray_num_cpus=4",
    ]
    trainer = Trainer(*load_config_and_secrets(REPO / "configs" / "demo_tools.yaml", overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
        import ray

        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/overall" in r]
    assert len(rows) == STEPS
    for key in (
        "multi_turn/turns_mean",
        "multi_turn/tool_call_rate",
        "multi_turn/tool_errors",
        "multi_turn/observation_tokens_mean",
        "multi_turn/truncated",
        "timing_s/tools",
    ):
        assert all(key in r for r in rows), key
    first, last = rows[:3], rows[-3:]
    assert _mean(last, "reward/overall") > _mean(first, "reward/overall") + 0.2
    assert _mean(last, "multi_turn/tool_call_rate") > _mean(first, "multi_turn/tool_call_rate") + 0.3
    # the reward function's own count of tool use agrees with the loop's
    assert all(r["reward/tool_call"] == pytest.approx(r["multi_turn/tool_call_rate"]) for r in rows)
