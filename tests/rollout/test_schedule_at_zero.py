"""The synchronous schedule is carry-over at `max_staleness = 0` (issue 43, item 3; docs/async.md, "S = 0"): the HF
engine serving the tool demo's model, one seed. Both schedules seed every call with `seeding.call_seed`, start the
same episodes and build rows with the same `rows_of`; at S = 0 the carry-over loop hands a step's groups over in the
prompts' order, pads as the synchronous loops pad, logs their metrics and makes their engine round trips. So its rows
and metrics are theirs:

- single turn: the rows bit for bit, plus the versioned record's two columns, in one `generate_sequences` call;
- tools: every row bit for bit, the same metrics, the same open / generate per turn / close.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.rollout import SamplingParams, SingleTurnLoop
from easyrl.rollout.carry_over import CarryOverLoop
from easyrl.rollout.episode import Episode, SingleTurnEpisode
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.multi_turn import ChatRenderer, ToolEpisode
from easyrl.seeding import call_seed
from tests.rollout.test_multi_turn import MODEL, LocalEngines, _loop, _prompts, _rows


MAX_LEN = 80
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=MAX_LEN, seed=7, logprobs=True)
RECORD_COLUMNS = {"token_policy_version", "rollout_sessions"}
"""What `rows_of` adds to the engines' row contract (the versioned record): the single-turn loop's rows lack them."""


class Engines(LocalEngines):
    """The test's engines, counting the calls a loop makes on them (the round trips)."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        super().__init__(engine)
        self.made: list[str] = []

    def open_rollout(self) -> dict[str, float]:
        self.made.append("open_rollout")
        return {"timing_s/wake": 0.0}

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.made.append("generate")
        return super().generate(prompts, params)

    def close_rollout(self) -> dict[str, float]:
        self.made.append("close_rollout")
        return {"timing_s/sleep": 0.0}

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        self.made.append("generate_sequences")
        return super().generate(prompts, params), {"timing_s/generate_engine": 0.0}  # one call counted

    def policy_version(self) -> int:  # what the carry-over loop counts staleness from (not asked at S = 0)
        return 0


def _same_rows(sync: Batch, carried: Batch) -> None:
    """Every tensor and column of the synchronous rows, to the bit, in their order."""
    assert set(sync.tensors) <= set(carried.tensors)
    different = [k for k in sync.tensors if not torch.equal(sync[k], carried[k])]
    assert not different, f"S = 0 through carry-over changed {different}"
    assert {k: carried[k] for k in sync.non_tensors} == dict(sync.non_tensors)


def _stable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(MODEL))


@pytest.fixture(scope="module")
def engine(chat: ChatRenderer) -> HFRolloutEngine:
    tok = chat.tokenizer
    return HFRolloutEngine(MODEL, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)


def _at_zero(chat: ChatRenderer, episode: Episode | None = None) -> CarryOverLoop:
    tok = chat.tokenizer
    return CarryOverLoop(
        lambda k: pytest.fail("at S = 0 the step's own prompts fill the admission room: none is drawn"),
        max_staleness=0,
        active_groups=4,
        chunk_tokens=MAX_LEN,
        max_response_length=MAX_LEN,
        stop_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        engines=2,
        episode=episode,
    )


def _single_turn_prompts(chat: ChatRenderer, rows: list[dict[str, Any]]) -> Batch:
    """The demo's questions rendered without tools and left-padded, as the data loader gives them."""
    encoded = [chat.encode(chat.render([{"role": "user", "content": r["prompt"]}], [])) for r in rows]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[chat.tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(e) for e in encoded])[:, None]).long()
    columns = {"uid": [f"p{i}" for i in range(len(rows))], "row": rows}
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}, columns
    )


def test_a_calls_seed_is_the_row_seed_then_its_row_children() -> None:
    assert [call_seed(700_021, c) for c in range(3)] == [700_021, 700_021 * 100_003 + 1, 700_021 * 100_003 + 2]
    siblings = {call_seed(row, c) for row in range(700_021, 700_029) for c in range(1000)}
    assert len(siblings) == 8 * 1000  # past a thousand calls too (a response cut into small carry-over chunks)


@pytest.mark.parametrize("logprobs", [True, False])
def test_single_turn_rows_and_metrics_at_zero_staleness_are_the_synchronous_ones(
    engine: HFRolloutEngine, chat: ChatRenderer, logprobs: bool
) -> None:
    prompts = _single_turn_prompts(chat, _rows(4))
    params = PARAMS.override({"logprobs": logprobs})
    sync_engines, engines = Engines(engine), Engines(engine)
    sync, sync_metrics = SingleTurnLoop().run(sync_engines, prompts, params)
    loop = _at_zero(chat)
    carried, metrics = loop.run(engines, prompts, params)
    assert isinstance(loop.episode, SingleTurnEpisode)  # carry-over's default episode
    # every tensor and column of the synchronous rows, to the bit, and the versioned record's two
    assert set(carried.tensors) - set(sync.tensors) == RECORD_COLUMNS
    _same_rows(sync, carried)
    assert ("rollout_log_probs" in carried) is logprobs
    assert len(set(map(tuple, carried["responses"].tolist()))) > 1  # sampled, not one greedy answer for all
    # the same metrics (here the engines' session timings alone: no async/*), from one round trip per engine
    assert metrics == sync_metrics == {"timing_s/generate_engine": 0.0}
    assert engines.made == sync_engines.made == ["generate_sequences"]
    assert loop.state_dict() == {}  # nothing in flight: a synchronous run's checkpoint


def test_a_synchronous_schedule_leaves_an_asynchronous_checkpoints_groups_untrained(
    chat: ChatRenderer, caplog: pytest.LogCaptureFixture
) -> None:
    loop = _at_zero(chat)
    with caplog.at_level("WARNING"):
        loop.load_state_dict({"max_staleness": 1, "groups": [{}, {}], "queue": [{}]})
    assert "holds 3 prompt groups in flight" in caplog.text and loop.groups == [] and not loop.queue


def test_tool_rows_and_metrics_at_zero_staleness_are_the_synchronous_ones(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    uids = [f"p{i}" for i in range(4)]
    sync_loop = _loop(chat)  # the synchronous schedule with the tool episode (`MultiTurnLoop`), 80 tokens a trajectory
    sync_engines, engines = Engines(engine), Engines(engine)
    sync, sync_metrics = sync_loop.run(sync_engines, _prompts(_rows(4)).set(uid=uids), PARAMS)
    shared = sync_loop.episode
    episode = ToolEpisode(shared.environments, chat, shared.budget, shared.tool_settings)
    carried, metrics = _at_zero(chat, episode).run(engines, _prompts(_rows(4)).set(uid=uids), PARAMS)
    # the same rows in the prompts' order, padded alike (to the longest response), to the bit
    assert set(carried.tensors) == set(sync.tensors) and carried["uid"] == sync["uid"]
    _same_rows(sync, carried)
    turns = [r["turns"] for r in sync["row"]]
    assert max(turns) > 1 and min(turns) == 1  # some trajectories called a tool, some answered at once
    # the same metrics (the wall-clock timings by name), from the same calls: open, one generate a turn, close
    assert metrics.keys() == sync_metrics.keys() and _stable(metrics) == _stable(sync_metrics)
    assert metrics["multi_turn/tool_call_rate"] > 0
    assert engines.made == sync_engines.made == ["open_rollout", *["generate"] * max(turns), "close_rollout"]
