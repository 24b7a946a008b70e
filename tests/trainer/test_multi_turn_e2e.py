"""The tool demo through the one trainer (Ray, 2 FSDP2 CPU workers, the HF engine, the multi-turn loop): reward and
tool-call rate both rise, every multi-turn metric is logged each step, and the engine's log-probs of the sampled
tokens, taken turn by turn, are the actor's over the whole multi-turn row (the rows are the tokens sampled). The
same under the carry-over schedule (`trainer.max_staleness: 1`), and with the vLLM engine (its CPU build), when
installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from easyrl.config import load_config_and_secrets
from tests.conftest import REPO


pytestmark = pytest.mark.slow
STEPS = 12


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _train(
    tmp_path: Path, steps: int, extra: list[str], val: list[dict[str, float]] | None = None
) -> list[dict[str, float]]:
    from easyrl.distributed import init_ray
    from easyrl.trainer.trainer import Trainer

    init_ray(num_cpus=4)
    overrides = [
        f"trainer.max_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={tmp_path / 'run'}",
        "trainer.ray_num_cpus=4",
        # the engine-vs-actor comparison on every sample (in the update's forward: one mini-batch, no pass)
        "worker.rollout.logprob_sample_ratio=1.0",
        *extra,
    ]
    trainer = Trainer(*load_config_and_secrets(REPO / "configs" / "demo_tools.yaml", overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
        import ray

        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    if val is not None:
        val += [r for r in rows if "val/reward/overall" in r]
    rows = [r for r in rows if "reward/overall" in r]
    assert len(rows) == steps
    for row in rows:  # one engine call per turn, one forward of the actor over the row: the same log-probs
        # (with staleness, over the tokens the compared weights sampled: a step may train none of them)
        assert row.get("rollout/logprob_diff_max", 0.0) < 1e-3, row["rollout/logprob_diff_max"]
    return rows


def test_the_tool_demo_learns_to_call_its_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the demo's paths are relative to the repository root
    val: list[dict[str, float]] = []
    rows = _train(tmp_path, STEPS, [f"trainer.val_freq={STEPS}"], val)  # validated after the last step
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
    # validation runs the same loop, tools included (a single-turn validation never calls one: 0.0)
    (last_val,) = val
    assert last_val["val/reward/tool_call"] > 0.3, last_val


def test_the_tool_demo_learns_with_one_step_of_staleness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool episode under the carry-over schedule (`trainer.max_staleness: 1`, calls of 20 tokens): reward and
    tool use rise as in the synchronous run, no trained token is older than one update (the bound is reached), and
    groups really were carried over to a later step."""
    monkeypatch.chdir(REPO)
    async_edits = ["trainer.max_staleness=1", "worker.rollout.chunk_tokens=20"]
    rows = _train(tmp_path, STEPS, async_edits)
    first, last = rows[:3], rows[-3:]
    assert _mean(last, "reward/overall") > _mean(first, "reward/overall") + 0.2
    assert _mean(last, "multi_turn/tool_call_rate") > _mean(first, "multi_turn/tool_call_rate") + 0.3
    assert all(r["reward/tool_call"] == pytest.approx(r["multi_turn/tool_call_rate"]) for r in rows)
    assert max(r["async/staleness_max"] for r in rows) == 1.0  # the bound, reached
    assert sum(r["async/groups_carried"] for r in rows) > 0


def test_a_resumed_tool_run_restarts_the_trajectories_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S = 1 with tools: the checkpoint holds the groups in flight but not their environments, so the resumed run
    starts their trajectories again from their prompts (docs/async.md) and trains on within the bound."""
    monkeypatch.chdir(REPO)
    edits = ["trainer.max_staleness=1", "worker.rollout.chunk_tokens=20", "trainer.save_freq=2"]
    _train(tmp_path, 2, edits)
    saved = json.loads((tmp_path / "run" / "global_step_2" / "trainer_state.json").read_text())
    in_flight = saved["state"]["rollout_loop"]["groups"]
    assert in_flight and all("episode_state" not in s for g in in_flight for s in g["samples"])
    rows = _train(tmp_path, 4, edits)  # resumes from global_step_2
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["async/staleness_max"] for r in rows) <= 1
    assert all(r["multi_turn/turns_mean"] >= 1 for r in rows)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_tool_demo_runs_on_the_vllm_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    rows = _train(tmp_path, 2, ["worker.rollout.name=vllm"])
    assert all(r["multi_turn/tool_call_rate"] > 0 and r["multi_turn/observation_tokens_mean"] > 0 for r in rows)
