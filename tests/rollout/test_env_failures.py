"""An environment that fails for some rows costs those trajectories, never the run; one that fails for most stops it
with one line naming the environment and its first error; one that hangs (`reset`, `get_reward`) is cut at
`env_timeout_s`, and the time to that error is measured (issue 45, items 3 and 4).

A real run on CPU: the synchronous multi-turn loop driving the HF engine serving the tool demo's model
(assets/demo_tools), with environments written as users write them."""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.agent import AgentRunError, load_environments
from easyrl.batch import Batch
from easyrl.config.multi_turn import MultiTurnConfig
from easyrl.rollout import SamplingParams
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.multi_turn import ChatRenderer, MultiTurnLoop, ToolSettings, TurnBudget


REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "demo_tools"
MODEL = str(ASSETS / "model")
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=5)
BUDGET = TurnBudget(max_turns=2, max_total_tokens=40, max_tokens_per_turn=40, max_prompt_length=64)

ENVS = '''
import time


class Flaky:
    """The demo's calculator, whose reset raises for every fourth trajectory."""

    started = 0

    def reset(self, prompt: str, **row) -> str:
        type(self).started += 1
        if type(self).started % 4 == 1:
            raise ConnectionError("the game server refused this row")
        return prompt

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b


class Broken(Flaky):
    """Raises for every row: a broken environment."""

    def reset(self, prompt: str, **row) -> str:
        raise ConnectionError("the game server is down")


class HungReset(Flaky):
    def reset(self, prompt: str, **row) -> str:
        time.sleep(60)
        return prompt


class HungReward(Flaky):
    def reset(self, prompt: str, **row) -> str:
        return prompt

    def get_reward(self) -> float:
        time.sleep(60)
        return 1.0
'''


class Engines:
    """An `EngineSession` in this process on the HF engine."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine

    def open_rollout(self) -> dict[str, float]:
        return {}

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = self.engine.generate(prompts, params)
        return rows.set(policy_version=torch.zeros(len(rows), dtype=torch.int64))

    def close_rollout(self) -> dict[str, float]:
        return {}

    def policy_version(self) -> int:
        return 0


@pytest.fixture(scope="module")
def engines() -> Engines:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return Engines(HFRolloutEngine(MODEL, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id))


def _prompts(k: int) -> Batch:
    rows = [json.loads(line) for line in (ASSETS / "train.jsonl").read_text().splitlines()]
    picked = list(itertools.islice(itertools.cycle(rows), k))
    ids = torch.full((k, 1), 7, dtype=torch.long)
    return Batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)},
        {"row": picked, "uid": [f"p{i}" for i in range(k)], "ground_truth": [r["answer"] for r in picked]},
    )


def _loop(tmp_path: Path, cls: str, **settings: Any) -> MultiTurnLoop:
    (tmp_path / "envs.py").write_text(ENVS)
    mt = MultiTurnConfig(env=f"{tmp_path / 'envs.py'}:{cls}", max_parallel_tools=2, **settings)
    from transformers import AutoTokenizer

    chat = ChatRenderer(AutoTokenizer.from_pretrained(MODEL))
    tools = ToolSettings(mt.tool_timeout_s, mt.max_tool_output_chars, mt.max_parallel_tools, mt.max_env_error_ratio)
    return MultiTurnLoop(load_environments(mt, lambda row: []), chat, BUDGET, tools)


def test_a_reset_that_raises_for_some_rows_drops_those_trajectories_and_the_run_goes_on(
    tmp_path: Path, engines: Engines
) -> None:
    rows, metrics = _loop(tmp_path, "Flaky").run(engines, _prompts(4), PARAMS)
    assert len(rows) == 16  # one row per trajectory, the dropped ones too: the batch keeps its shape
    dropped = [i for i, reason in enumerate(rows["stop_reason"]) if reason == "env_error"]
    assert dropped == [0, 4, 8, 12]  # every fourth reset raised
    for i in dropped:
        assert (
            "Flaky.reset(**row) raised ConnectionError: the game server refused this row"
            in rows["row"][i]["env_error"]
        )
        assert not rows["loss_mask"][i].any()  # nothing of a dropped trajectory is trained
    kept = [i for i in range(16) if i not in dropped]
    assert all(rows["loss_mask"][i].any() for i in kept) and all(rows["row"][i]["env_error"] is None for i in kept)
    assert metrics["multi_turn/dropped"] == 4.0 and metrics["multi_turn/failed"] == 0.25


def test_past_the_error_ratio_the_run_stops_with_one_line_naming_the_environment(
    tmp_path: Path, engines: Engines
) -> None:
    with pytest.raises(AgentRunError) as info:
        _loop(tmp_path, "Broken").run(engines, _prompts(2), PARAMS)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "8 of 8 trajectories of this step failed in their environment or tools (more than "
        "worker.rollout.multi_turn.max_env_error_ratio=0.5); the first: environment default: "
    )
    assert "Broken.reset(**row) raised ConnectionError: the game server is down" in message
    # at the ratio itself the run goes on: 4 of 16 failed with a ratio of 0.25
    _loop(tmp_path, "Flaky", max_env_error_ratio=0.25).run(engines, _prompts(4), PARAMS)


@pytest.mark.parametrize(
    ("cls", "what"),
    [
        ("HungReset", "HungReset() and reset(**row) did not finish within 0.5s"),
        ("HungReward", "get_reward() failed: did not finish within 0.5s"),
    ],
)
def test_a_hung_reset_or_get_reward_is_an_error_within_its_deadline_never_a_hang(
    tmp_path: Path, engines: Engines, cls: str, what: str
) -> None:
    """Every row hangs (60 s each): two calls (`max_parallel_tools`) wait out the 0.5 s deadline, the rest are
    refused at once, and the step ends with the error line in seconds, not in 8 x 60 s."""
    loop = _loop(tmp_path, cls, env_timeout_s=0.5)
    start = time.perf_counter()
    with pytest.raises(AgentRunError, match=re.escape(f"the first: environment default: {what}")):
        loop.run(engines, _prompts(2), PARAMS)
    seconds = time.perf_counter() - start
    print(f"time to error, {cls} on every row: {seconds:.2f} s")
    assert seconds < 30
