"""A resume with tool trajectories in flight (carry-over, `trainer.max_staleness: 1`): the loop's state goes through
JSON as a checkpoint's does, a new loop with freshly loaded environments takes it, and its next steps are the
uninterrupted loop's to the bit, whether the environment saves its own state (`state_dict` / `load_state_dict`) or is
rebuilt by replaying its calls; an environment whose replay differs restarts those trajectories, counted and warned.

A real run on CPU: the HF engine serving the tool demo's model (assets/demo_tools), the tool episode, and the demo's
calculator (tests/assets/calc_resume_envs.py) loaded from its file as a config names it."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest
import torch

from easyrl.agent import load_environments
from easyrl.batch import Batch
from easyrl.config.multi_turn import MultiTurnConfig
from easyrl.rollout.carry_over import CarryOverLoop, Group
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.multi_turn import ChatRenderer, ToolEpisode, ToolSettings, TurnBudget
from easyrl.rollout.trajectory import Trajectory
from tests.rollout.test_env_reward_once import ASSETS, MODEL, PARAMS, REPO, Engines


ENVS = REPO / "tests" / "assets" / "calc_resume_envs.py"
PER_STEP, SAVED_AT, STEPS = 2, 3, 5  # the state is saved after step 3 of 5 (groups with tool calls are in flight)
# wall-clock figures, and the wait window a resumed loop starts afresh
VOLATILE = ("timing_s/", "async/trainer_", "async/engine_wait", "async/engine_idle")


@pytest.fixture(scope="module")
def parts() -> tuple[HFRolloutEngine, ChatRenderer]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    engine = HFRolloutEngine(MODEL, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)
    return engine, ChatRenderer(tok)


class Draw:
    """The demo's prompts in order from `taken` on, each with a numbered `uid`: the trainer's sampler, whose
    position a checkpoint keeps."""

    def __init__(self, taken: int = 0) -> None:
        self.rows = [json.loads(line) for line in (ASSETS / "train.jsonl").read_text().splitlines()]
        self.taken = taken

    def __call__(self, k: int) -> Batch:
        picked = [self.rows[(self.taken + i) % len(self.rows)] for i in range(k)]
        uids = [f"p{self.taken + i}" for i in range(k)]
        self.taken += k
        ids = torch.zeros(k, 1, dtype=torch.long)
        return Batch(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)},
            {"row": picked, "uid": uids, "ground_truth": [r["answer"] for r in picked]},
        )


def _loop(chat: ChatRenderer, env: str, draw: Draw) -> CarryOverLoop:
    """A carry-over loop (S = 1, calls of 8 tokens) driving the tool episode over a freshly loaded `env` class; tools
    run one at a time, so that the calls' order, and a class's counts, are the same in every run."""
    environments = load_environments(MultiTurnConfig(env=f"{ENVS}:{env}"), lambda row: [])
    budget = TurnBudget(max_turns=3, max_total_tokens=80, max_tokens_per_turn=80, max_prompt_length=64)
    return CarryOverLoop(
        draw,
        max_staleness=1,
        active_groups=2 * PER_STEP,
        chunk_tokens=8,
        max_response_length=80,
        stop_ids=[chat.tokenizer.eos_token_id],
        pad_id=chat.tokenizer.pad_token_id,
        engines=1,
        episode=ToolEpisode(environments, chat, budget, ToolSettings(5.0, 200, 1)),
    )


def _steps(loop: CarryOverLoop, engines: Engines, draw: Draw, steps: range) -> list[tuple[Batch, dict[str, float]]]:
    params = dataclasses.replace(PARAMS, n=8)
    return [loop.run(engines, draw(PER_STEP), dataclasses.replace(params, seed=step)) for step in steps]


def _env_class(loop: CarryOverLoop) -> Any:
    episode = loop.episode
    assert isinstance(episode, ToolEpisode)
    return next(iter(episode.environments.types.values())).cls


def _run_and_resume(parts: tuple[HFRolloutEngine, ChatRenderer], env: str) -> dict[str, Any]:
    """The uninterrupted loop's steps after `SAVED_AT`, a resumed loop's, the state it resumed from, and the env
    class's `mul` calls made while the resumed loop loaded it."""
    engine, chat = parts
    draw, engines = Draw(), Engines(engine)
    loop = _loop(chat, env, draw)
    _steps(loop, engines, draw, range(SAVED_AT))
    saved = json.loads(json.dumps(loop.state_dict()))  # what trainer_state.json holds
    version, taken = engines.version, draw.taken
    uninterrupted = _steps(loop, engines, draw, range(SAVED_AT, STEPS))
    resumed_draw = Draw(taken)
    resumed = _loop(chat, env, resumed_draw)  # the file imported again (new classes, counts at 0): a new process
    resumed.load_state_dict(saved)
    cls = _env_class(resumed)
    replayed = cls.calls
    engines.version = version  # the policy's version, as the trainer restores it
    again = _steps(resumed, engines, resumed_draw, range(SAVED_AT, STEPS))
    return {"uninterrupted": uninterrupted, "resumed": again, "saved": saved, "replayed": replayed, "cls": cls}


def _in_flight(saved: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for g in saved["groups"] for s in g["samples"]]


def _assert_same(first: list[tuple[Batch, dict[str, float]]], second: list[tuple[Batch, dict[str, float]]]) -> None:
    for (rows, metrics), (rows2, metrics2) in zip(first, second, strict=True):
        assert set(rows.tensors) == set(rows2.tensors) and set(rows.non_tensors) == set(rows2.non_tensors)
        for key in rows.tensors:
            assert torch.equal(rows[key], rows2[key]), key
        for key in rows.non_tensors:
            assert rows[key] == rows2[key], key
        stable = {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}
        stable2 = {k: v for k, v in metrics2.items() if not k.startswith((*VOLATILE, "rollout/resume_"))}
        assert stable == stable2


def test_an_environment_without_state_is_replayed_and_the_resume_is_exact(
    parts: tuple[HFRolloutEngine, ChatRenderer],
) -> None:
    out = _run_and_resume(parts, "ReplayedCalcEnv")
    in_flight = _in_flight(out["saved"])
    # the state holds trajectories mid-episode: tools called, more turns to come; no environment state of their own
    assert any(s["episode_state"]["ran"] and not s["done"] for s in in_flight)
    assert all(s["episode_state"]["env_state"] is None for s in in_flight)
    recorded = sum(r["name"] == "mul" and r["error"] is None for s in in_flight for r in s["episode_state"]["ran"])
    assert out["replayed"] == recorded > 0  # every recorded call to the environment ran again, and nothing else
    _assert_same(out["uninterrupted"], out["resumed"])
    first = out["resumed"][0][1]
    assert first["rollout/resume_restarts"] == 0.0
    assert first["rollout/resume_exact"] == sum(
        len(g["samples"]) for g in [*out["saved"]["queue"], *out["saved"]["groups"]]
    )
    assert "rollout/resume_exact" not in out["resumed"][1][1]  # logged once, at the step after the resume


def test_an_environment_with_state_dict_is_restored_from_it_and_the_resume_is_exact(
    parts: tuple[HFRolloutEngine, ChatRenderer],
) -> None:
    out = _run_and_resume(parts, "SavedCalcEnv")
    in_flight = _in_flight(out["saved"])
    assert any(s["episode_state"]["ran"] and not s["done"] for s in in_flight)
    # its state is saved beside each record (the tool calls made so far), and loaded instead of a replay
    made = [s["episode_state"]["env_state"]["state"]["made"] for s in in_flight]
    assert made == [
        sum(r["name"] == "mul" and not r["is_error"] for r in s["episode_state"]["ran"]) for s in in_flight
    ]
    assert max(made) > 0
    assert out["replayed"] == 0 and out["cls"].loads >= len(in_flight)
    _assert_same(out["uninterrupted"], out["resumed"])
    assert out["resumed"][0][1]["rollout/resume_restarts"] == 0.0


def test_an_environment_whose_replay_differs_restarts_those_trajectories_counted_and_warned(
    parts: tuple[HFRolloutEngine, ChatRenderer], caplog: pytest.LogCaptureFixture
) -> None:
    engine, chat = parts
    draw, engines = Draw(), Engines(engine)
    loop = _loop(chat, "DriftingCalcEnv", draw)
    _steps(loop, engines, draw, range(1))  # its answers change what the model writes next: the calls are early
    saved = json.loads(json.dumps(loop.state_dict()))
    records = [s for g in [*saved["queue"], *saved["groups"]] for s in g["samples"]]
    # a call that really ran the tool answers with a new request id when replayed; malformed ones replay alike
    drifted = sum(any(r["error"] is None and not r["is_error"] for r in s["episode_state"]["ran"]) for s in records)
    assert drifted > 0
    resumed_draw = Draw(draw.taken)
    resumed = _loop(chat, "DriftingCalcEnv", resumed_draw)
    with caplog.at_level(logging.WARNING, logger="easyrl.rollout.multi_turn"):
        resumed.load_state_dict(saved)
    (warning,) = [r.getMessage() for r in caplog.records if "start again from their prompts" in r.getMessage()]
    assert (
        "calc_resume_envs.py:DriftingCalcEnv" in warning
        and "state_dict()" in warning
        and f"{drifted} tool trajectories" in warning
    )
    restarted = [s for g in resumed.groups for s in g.samples if not s.response_ids]
    assert len(restarted) >= drifted  # from their prompts again (with any not yet started)
    ((rows, metrics),) = _steps(resumed, engines, resumed_draw, range(1, 2))
    assert metrics["rollout/resume_restarts"] == float(drifted)
    assert metrics["rollout/resume_exact"] == len(records) - drifted
    assert len(rows) == PER_STEP * 8 and metrics["async/staleness_max"] <= 1


def test_a_sample_the_chat_template_restarted_keeps_its_own_prompt_through_a_checkpoint() -> None:
    """The exact-prefix rule may give a tool trajectory a new prompt (`Trajectory.restart`): its record keeps that
    prompt, while its siblings keep the group's."""
    split = Trajectory([1, 2, 3])
    split.restart([1, 9, 9, 9])
    split.append([5, 6], trained=True, log_probs=[-0.5, -0.25], version=0)
    group = Group([1, 2, 3], {"uid": "g"}, seed=3, samples=[Trajectory([1, 2, 3]), split])
    from easyrl.rollout.episode import SingleTurnEpisode

    back = Group.from_state(json.loads(json.dumps(group.state_dict(SingleTurnEpisode(8)))))
    assert [s.prompt_ids for s in back.samples] == [[1, 2, 3], [1, 9, 9, 9]]
    assert back.samples[1].context() == [1, 9, 9, 9, 5, 6]
