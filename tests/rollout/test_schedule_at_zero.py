"""The synchronous schedule and carry-over at `max_staleness = 0` (issue 43, item 3; docs/async.md, "S = 0"): the HF
engine serving the tool demo's model, one engine call per completion (`chunk_tokens` = `max_response_length`), one
seed. Both schedules seed every call with `seeding.call_seed`, start the same episodes and build rows with the same
`rows_of`, so they sample the same trajectories, token for token:

- single turn: the carry-over loop's rows are the synchronous loop's bit for bit, plus the versioned record's two
  columns; only the metrics differ (`async/*`);
- tools: the same trajectories, but handed over in the order their groups finished, and padded to
  `max_response_length` rather than to the longest response.

What still keeps the producer on two schedules at S = 0 is written in docs/async.md.
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
    def policy_version(self) -> int:  # what the carry-over loop counts staleness from
        return 0


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


def test_single_turn_rows_at_zero_staleness_are_the_synchronous_ones_bit_for_bit(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    prompts = _single_turn_prompts(chat, _rows(4))
    sync, sync_metrics = SingleTurnLoop().run(Engines(engine), prompts, PARAMS)
    loop = _at_zero(chat)
    carried, metrics = loop.run(Engines(engine), prompts, PARAMS)
    assert isinstance(loop.episode, SingleTurnEpisode)  # carry-over's default episode
    # every tensor and column of the synchronous rows, to the bit, and the versioned record's two columns
    assert set(carried.tensors) - set(sync.tensors) == RECORD_COLUMNS and set(sync.tensors) <= set(carried.tensors)
    different = [k for k in sync.tensors if not torch.equal(sync[k], carried[k])]
    assert not different, f"S = 0 through carry-over changed {different}"
    assert {k: carried[k] for k in sync.non_tensors} == dict(sync.non_tensors)
    assert len(set(map(tuple, carried["responses"].tolist()))) > 1  # sampled, not one greedy answer for all
    # differs: the metrics (the synchronous loop has only the engines' timings, none here; carry-over its async/*)
    assert sync_metrics == {} and {"async/engine_calls", "async/staleness/0"} <= set(metrics)
    assert metrics["async/engine_calls"] == 1.0 and metrics["async/groups_carried"] == 0.0


def _trimmed(rows: Batch, i: int) -> tuple[list[int], list[int], list[float], list[int]]:
    """Row `i`'s prompt (left-padded alike by both: to the longest prompt), then its response's tokens, loss mask and
    log-probs without the padding."""
    length = int(rows["response_mask"][i].sum())
    return (
        rows["prompts"][i].tolist(),
        rows["responses"][i, :length].tolist(),
        rows["loss_mask"][i, :length].tolist(),
        rows["rollout_log_probs"][i, :length].tolist(),
    )


def test_tool_trajectories_are_the_synchronous_ones_in_the_order_their_groups_finished(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    n = PARAMS.n
    uids = [f"p{i}" for i in range(4)]
    sync_loop = _loop(chat)  # the synchronous schedule with the tool episode (`MultiTurnLoop`), 80 tokens a trajectory
    sync, _ = sync_loop.run(Engines(engine), _prompts(_rows(4)).set(uid=uids), PARAMS)
    shared = sync_loop.episode
    episode = ToolEpisode(shared.environments, chat, shared.budget, shared.tool_settings)
    carried, metrics = _at_zero(chat, episode).run(Engines(engine), _prompts(_rows(4)).set(uid=uids), PARAMS)
    assert sorted(carried["uid"]) == sorted(sync["uid"]) and len(carried) == len(sync) == 4 * n
    # differs: the padding (the synchronous rows end at the longest response, carry-over's at max_response_length)
    longest = int(sync["response_mask"].sum(dim=1).max())
    assert sync["responses"].shape[1] == longest < MAX_LEN == carried["responses"].shape[1]
    # differs: the order. Groups go over as they finished: those whose samples all answered in one call first, then
    # those with a tool call (two calls), each in admission order; the synchronous loop keeps the prompts' order.
    calls = {u: max(sync["row"][i]["turns"] for i in range(len(sync)) if sync["uid"][i] == u) for u in uids}
    by_finish = sorted(uids, key=lambda u: calls[u])
    assert carried["uid"][::n] == by_finish != uids, (calls, carried["uid"][::n])
    # shared: put back in the prompts' order, every trajectory is the synchronous one, token for token
    place = {u: k for k, u in enumerate(carried["uid"][::n])}
    for i in range(len(sync)):
        j = place[sync["uid"][i]] * n + i % n
        assert _trimmed(carried, j) == _trimmed(sync, i), f"row {i}"
        assert carried["row"][j]["turns"] == sync["row"][i]["turns"]
    assert metrics["multi_turn/tool_call_rate"] > 0  # the tool episode ran its calls under both schedules
