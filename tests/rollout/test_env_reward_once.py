"""An environment's `get_reward()` runs exactly once per finished trajectory, and the score trained on is that one
result: under the carry-over schedule (`trainer.max_staleness: 1`), whose early scoring makes a finished group's rows
before the hand-over makes them again, and under the synchronous multi-turn loop.

A real run on CPU: the HF engine serving the tool demo's model (assets/demo_tools), the tool episode, an environment
written as docs/agentic.md tells users to (its `get_reward` counts its own calls), and the reward manager with
reward_functions/env.py (the score is the environment's reward)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.agent import Environments, load_environments
from easyrl.batch import Batch
from easyrl.config.multi_turn import MultiTurnConfig
from easyrl.config.worker import RewardConfig
from easyrl.rewards import RewardManager
from easyrl.rollout import SamplingParams
from easyrl.rollout.carry_over import CarryOverLoop
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.loop import Scored
from easyrl.rollout.multi_turn import ChatRenderer, MultiTurnLoop, ToolEpisode, ToolSettings, TurnBudget


REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "demo_tools"
MODEL = str(ASSETS / "model")
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=80, seed=11)

# The demo's calculator with a `get_reward` that logs each call: (trajectory number, value returned). The value holds
# the number, so a trained score names the trajectory it came from.
COUNTING_ENV = '''
class CountingCalcEnv:
    started = 0
    reward_calls = []

    def reset(self, prompt: str, **row) -> str:
        type(self).started += 1
        self.number = type(self).started
        self.calls = 0
        return prompt

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        value = 1000.0 * self.calls + self.number
        type(self).reward_calls.append((self.number, value))
        return value
'''


class Engines:
    """An `EngineSession` in this process on the HF engine; the policy version moves on with every session."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine, self.version = engine, 0

    def open_rollout(self) -> dict[str, float]:
        self.version += 1
        return {}

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = self.engine.generate(prompts, params)
        return rows.set(policy_version=torch.full((len(rows),), self.version, dtype=torch.int64))

    def close_rollout(self) -> dict[str, float]:
        return {}

    def policy_version(self) -> int:
        return self.version

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        return self.generate(prompts, params), self.open_rollout() | self.close_rollout()


@pytest.fixture(scope="module")
def parts() -> tuple[HFRolloutEngine, ChatRenderer]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    engine = HFRolloutEngine(MODEL, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)
    return engine, ChatRenderer(tok)


@pytest.fixture
def environments(tmp_path: Path) -> Environments:
    (tmp_path / "counting_env.py").write_text(COUNTING_ENV)
    return load_environments(MultiTurnConfig(env=f"{tmp_path / 'counting_env.py'}:CountingCalcEnv"), lambda row: [])


def _env_class(environments: Environments) -> Any:
    return next(iter(environments.types.values())).cls


def _prompt_source() -> Any:
    """`draw(k)`: the next `k` demo prompts (cycling), each with a fresh `uid`, as the trainer's sampler gives them."""
    rows = [json.loads(line) for line in (ASSETS / "train.jsonl").read_text().splitlines()]
    cycle, uids = itertools.cycle(rows), itertools.count()

    def draw(k: int) -> Batch:
        picked = [next(cycle) for _ in range(k)]
        ids = torch.zeros(k, 1, dtype=torch.long)
        return Batch(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)},
            {"row": picked, "uid": [f"p{next(uids)}" for _ in picked], "ground_truth": [r["answer"] for r in picked]},
        )

    return draw


def _scorer(manager: RewardManager) -> Any:
    def score(rows: Batch) -> Scored:
        scores, metrics = manager.score([dict(row) for row in rows["row"]])
        return scores, metrics, [""] * len(rows)

    return score


def _check_trained_once(rows: Batch, scored: Scored, reward_calls: list[tuple[int, float]]) -> None:
    """Every trajectory trained on had its reward read exactly once, and its score is the value returned."""
    calls = Counter(number for number, _ in reward_calls)
    returned = dict(reward_calls)
    scores, _, _ = scored
    for row, score in zip(rows["row"], scores):
        number = int(row["env_reward"]) % 1000
        assert calls[number] == 1, f"get_reward() ran {calls[number]} times for trajectory {number}"
        assert score["overall"] == row["env_reward"] == returned[number]


def test_the_environment_reward_runs_once_per_trajectory_under_carry_over(
    parts: tuple[HFRolloutEngine, ChatRenderer], environments: Environments
) -> None:
    engine, chat = parts
    budget = TurnBudget(max_turns=3, max_total_tokens=80, max_tokens_per_turn=80, max_prompt_length=64)
    episode = ToolEpisode(environments, chat, budget, ToolSettings(5.0, 200, 4))
    draw, per_step, engines = _prompt_source(), 2, Engines(engine)
    with RewardManager(
        RewardConfig(reward_function=f"{REPO / 'reward_functions' / 'env.py'}:compute_score", num_workers=0)
    ) as rm:
        scorer = _scorer(rm)
        loop = CarryOverLoop(
            draw,
            max_staleness=1,
            active_groups=2 * per_step,
            chunk_tokens=20,  # a turn spans several engine calls, some groups finish while others go on
            max_response_length=80,
            stop_ids=[chat.tokenizer.eos_token_id],
            pad_id=chat.tokenizer.pad_token_id,
            engines=1,
            scorer=scorer,
            episode=episode,
        )
        try:
            reward_calls = _env_class(environments).reward_calls
            trained, carried, tool_calls = 0, 0.0, 0
            for step in range(3):
                rows, metrics = loop.run(engines, draw(per_step), dataclasses.replace(PARAMS, seed=step))
                scored = loop.score(rows, scorer)
                assert scored[1]["async/scored_early"] == 1.0  # the scores came from the early scoring
                _check_trained_once(rows, scored, reward_calls)
                trained, carried = trained + len(rows), carried + metrics["async/groups_carried"]
                tool_calls += sum(row["tool_calls"] for row in rows["row"])
        finally:
            loop.close()
    # no trajectory's reward ran twice, in flight or trained; the ones carried over are scored already
    assert max(Counter(number for number, _ in reward_calls).values()) == 1
    assert trained == 3 * per_step * PARAMS.n and carried > 0 and len(reward_calls) >= trained
    assert tool_calls > 0  # the environment changed under its tool calls before its reward was read


def test_the_environment_reward_runs_once_per_trajectory_in_the_synchronous_loop(
    parts: tuple[HFRolloutEngine, ChatRenderer], environments: Environments
) -> None:
    engine, chat = parts
    budget = TurnBudget(max_turns=3, max_total_tokens=80, max_tokens_per_turn=80, max_prompt_length=64)
    loop = MultiTurnLoop(environments, chat, budget, ToolSettings(5.0, 200, 4))
    with RewardManager(
        RewardConfig(reward_function=f"{REPO / 'reward_functions' / 'env.py'}:compute_score", num_workers=0)
    ) as rm:
        rows, _ = loop.run(Engines(engine), _prompt_source()(4), PARAMS)
        scored = loop.score(rows, _scorer(rm))
    reward_calls = _env_class(environments).reward_calls
    _check_trained_once(rows, scored, reward_calls)
    assert len(reward_calls) == len(rows) == 4 * PARAMS.n
    assert any(row["tool_calls"] for row in rows["row"])  # calls the tool: `get_reward` sees a changed environment
