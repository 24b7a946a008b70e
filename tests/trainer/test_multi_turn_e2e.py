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


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
STEPS = 12


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _train(
    tmp_path: Path, steps: int, extra: list[str], val: list[dict[str, float]] | None = None, expect: int | None = None
) -> list[dict[str, float]]:
    """`steps` steps of the tool demo with `extra` overrides; returns its rows with a reward (`expect` of them:
    default `steps`, fewer for a run resumed in a fresh folder)."""
    from easyrl.trainer.trainer import Trainer

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
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    if val is not None:
        val += [r for r in rows if "val/reward/overall" in r]
    rows = [r for r in rows if "reward/overall" in r]
    assert len(rows) == (steps if expect is None else expect)
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


# wall-clock figures, the wait window a resumed run starts afresh, the share of rows scored beside the engines (a
# resumed run scores the groups it did not see finish at the reward stage: the same scores), and the resume's counts
RESUME_VOLATILE = (
    "timing_s/",
    "timing_per_token_ms/",
    "perf/",
    "async/trainer_",
    "async/engine_wait",
    "async/engine_idle",
    "async/scored_early",
    "rollout/resume_",
)


# calls of 4 tokens: at step 3's checkpoint 17 trajectories are between a tool call and their next turn
RESUME_EDITS = ["trainer.max_staleness=1", "worker.rollout.chunk_tokens=4", "trainer.save_freq=3"]
DEMO_ENV = "envs/calc.py:CalcEnv"  # configs/demo_tools.yaml's


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, float]]]:
    """The demo's S = 1 tool run of 4 steps, saving at step 3: (its folder, its rows), shared by both environments
    of the resume test below (one run instead of one per environment)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # the demo's paths are relative to the repository root
        return folder, _train(folder, 4, RESUME_EDITS)


@pytest.mark.parametrize("env", [DEMO_ENV, "tests/assets/calc_resume_envs.py:SavedCalcEnv"])
def test_a_resumed_tool_run_continues_the_trajectories_in_flight_to_the_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str, uninterrupted: tuple[Path, list[dict[str, float]]]
) -> None:
    """S = 1 with tools, stopped after step 3 and resumed from its checkpoint: the checkpoint holds the trajectories
    in flight with their conversations and the tool calls they ran, and the resumed run rebuilds each environment
    (the demo's `CalcEnv` by replaying its calls; one with `state_dict` from its saved state) and gives the
    uninterrupted demo run's step 4 to the bit (the two environments answer alike). The demo's environment resumes
    from the uninterrupted run's own step-3 checkpoint (what a run killed after step 3 leaves); the other from a
    3-step run of its own."""
    monkeypatch.chdir(REPO)
    full_folder, full = uninterrupted
    edits = [*RESUME_EDITS, f"worker.rollout.multi_turn.env={env}"]
    if env == DEMO_ENV:
        checkpoint = full_folder / "run" / "global_step_3"
    else:
        _train(tmp_path / "split", 3, edits)
        checkpoint = tmp_path / "split" / "run" / "global_step_3"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    in_flight = [s for g in saved["state"]["rollout_loop"]["groups"] for s in g["samples"]]
    assert any(s["episode_state"]["ran"] and not s["done"] for s in in_flight), "no tool trajectory mid-episode"
    assert all((s["episode_state"]["env_state"] is not None) == env.endswith("SavedCalcEnv") for s in in_flight)
    rows = _train(tmp_path / "resumed", 4, [*edits, f"trainer.load_checkpoint_path={checkpoint}"], expect=1)
    assert [r["step"] for r in rows] == [4]
    assert rows[0]["rollout/resume_restarts"] == 0 and rows[0]["rollout/resume_exact"] > 0

    def stable(rows: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in r.items() if not k.startswith(RESUME_VOLATILE)} for r in rows]

    assert stable(rows) == stable(full[3:]), "the resumed run left the uninterrupted curve"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_tool_demo_runs_on_the_vllm_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    import ray

    ray.shutdown()  # the run starts Ray anew with the vLLM engine's environment in every worker
    rows = _train(tmp_path, 2, ["worker.rollout.name=vllm"])
    assert all(r["multi_turn/tool_call_rate"] > 0 and r["multi_turn/observation_tokens_mean"] > 0 for r in rows)
