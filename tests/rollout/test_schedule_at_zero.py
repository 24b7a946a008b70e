"""The synchronous schedule is carry-over at `max_staleness = 0` (issue 43, item 3; docs/async.md, "S = 0"): the HF
engine serving the tool demo's model, one seed. The producer builds `CarryOverLoop` for every run; at S = 0 it hands
a step's groups over in the prompts' order, pads as the synchronous rows are padded, logs their metrics and makes
their engine round trips. Compared with the synchronous rows:

- single turn: the engines' own rows (`SingleTurnLoop`) bit for bit, plus the versioned record's two columns, in one
  `generate_sequences` call;
- tools: the synchronous tool schedule written out plainly (`_synchronous_tool_rows`, as its own loop ran it):
  every row bit for bit, the same metrics, the same open / generate per turn / close.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.rollout import SamplingParams, SingleTurnLoop
from easyrl.rollout.carry_over import CarryOverLoop
from easyrl.rollout.episode import Episode, SingleTurnEpisode, after_call, apply_step
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.multi_turn import ChatRenderer, ToolEpisode
from easyrl.rollout.trajectory import append_call, request_of, rows_of
from easyrl.seeding import call_seed, prompt_seeds
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


def _synchronous_tool_rows(
    episode: ToolEpisode, engines: Engines, prompts: Batch, params: SamplingParams
) -> tuple[Batch, dict[str, float]]:
    """The synchronous tool schedule written out plainly, as its own loop ran it before the carry-over loop took it
    over: every trajectory starts from its prompt in one engine session; each turn one engine call continues the live
    ones (seeded `call_seed(row seed, turn)`, asking the largest token limit), then the episode says what follows."""
    assert params.seed is not None
    tok, n = episode.chat.tokenizer, params.n
    firsts = prompt_seeds(params.seed, len(prompts), n).tolist()
    mask = prompts["attention_mask"].bool()
    columns = [{k: v[p] for k, v in prompts.non_tensors.items()} for p in range(len(prompts))]
    starts = [(prompts["input_ids"][p][mask[p]].tolist(), columns[p]) for p in range(len(prompts)) for _ in range(n)]
    trajectories = [episode.start(ids, row) for ids, row in starts]
    seeds = [firsts[i // n] + i % n for i in range(len(trajectories))]
    stop_ids = frozenset({tok.eos_token_id, *params.stop_token_ids})
    metrics = engines.open_rollout()
    while live := [t for t in trajectories if not t.done]:
        limits = [episode.token_limit(t) for t in live]
        turn_seeds = [call_seed(seeds[trajectories.index(t)], t.turns) for t in live]
        request = request_of([t.context() for t in live], turn_seeds, tok.pad_token_id, engines.count)
        out = engines.generate(request, params.override({"n": 1, "max_tokens": max(limits)}))
        lengths = out["response_mask"].sum(dim=1).tolist()
        ended = []
        for i, (traj, limit) in enumerate(zip(live, limits)):
            count = int(lengths[i])
            by_token = count > 0 and int(out["responses"][i, count - 1]) in stop_ids
            keep, how = after_call(traj, count, max(limits), by_token, limit)
            append_call(traj, out, i, keep, 1, per_row_logprobs=True)
            traj.turns += 1
            assert how is not None, "a call as long as the longest limit ends every completion"
            ended.append((traj, how))
        for (traj, _), step in zip(ended, episode.after(ended, stop_ids)):
            apply_step(traj, step)
    metrics |= engines.close_rollout() | {"timing_s/generate_turns": 0.0, "timing_s/tools": 0.0}
    rows = rows_of(trajectories, tok.pad_token_id).set(**episode.columns(trajectories))
    return rows, metrics | episode.metrics(trajectories)


def test_tool_rows_and_metrics_at_zero_staleness_are_the_synchronous_ones(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    uids = [f"p{i}" for i in range(4)]
    loop = _loop(chat)  # the synchronous schedule with the tool episode (`MultiTurnLoop`), 80 tokens a trajectory
    assert isinstance(loop, CarryOverLoop) and loop.max_staleness == 0
    reference_engines, engines = Engines(engine), Engines(engine)
    shared = loop.episode
    episode = ToolEpisode(shared.environments, chat, shared.budget, shared.tool_settings)
    sync, sync_metrics = _synchronous_tool_rows(episode, reference_engines, _prompts(_rows(4)).set(uid=uids), PARAMS)
    carried, metrics = loop.run(engines, _prompts(_rows(4)).set(uid=uids), PARAMS)
    # the same rows in the prompts' order, padded alike (to the longest response), to the bit
    assert set(carried.tensors) == set(sync.tensors) and carried["uid"] == sync["uid"]
    _same_rows(sync, carried)
    turns = [r["turns"] for r in sync["row"]]
    assert max(turns) > 1 and min(turns) == 1  # some trajectories called a tool, some answered at once
    # the same metrics (the wall-clock timings by name), from the same calls: open, one generate a turn, close
    assert metrics.keys() == sync_metrics.keys() and _stable(metrics) == _stable(sync_metrics)
    assert metrics["multi_turn/tool_call_rate"] > 0
    assert engines.made == reference_engines.made == ["open_rollout", *["generate"] * max(turns), "close_rollout"]
