"""Colocated asynchronous rollouts with carry-over (`trainer.max_staleness: S >= 1`): a `RolloutLoop` that keeps more
prompt groups in flight than a step trains on, hands the trainer the groups that finish first, and carries the rest
to the next step, where they resume with the new weights (a partial rollout).

One step, seen from the loop (the engines share the device with training, so they generate only inside the step's
engine session):

1. Admit groups: the trainer's B prompts of this step join a queue; groups leave it (the loop draws more prompts when
   it is empty) while `admitted < (S + k + 1) * B` and fewer than `worker.rollout.active_groups` are in flight, `k`
   being the batches handed to the trainer so far. Every group admitted up to step `k` thus fits in steps `k .. k+S`:
   no sample is born stale (AReaL, SkyRL and torchtitan's windowed FIFO bound it the same way).
2. Open the session (wake, push the new weights) and generate in calls of `chunk_tokens` tokens per response: each
   call continues every unfinished response from its prompt and the tokens it has so far, with the weights the
   engines hold now. A call is the granularity at which a response can be cut off (docs/async.md: the HF engine and
   vLLM's offline `generate` both finish what they are given; neither is interrupted mid-call).
3. Stop after the call that leaves B groups finished among which the step can meet every deadline: a group admitted
   at step `a` must train by step `a + S`, so at most `t * B` of the groups admitted by step `k + t - S` may be left
   for the `t` steps after this one (`choose_groups`). Close the session; unfinished responses keep their tokens,
   behaviour log-probs and the policy version of each token.
4. Hand over B groups: those the deadlines need, then the others in the order they finished.

With `worker.rollout.placement: separate` the engines have devices of their own, and the loop generates beside the
training: before handing a step over it starts one more call (`beside`) for the unfinished responses of the groups
left in flight, with the weights the engines hold (pushed first when the policy moved: they are never older than the
policy being handed the batch), and returns while that call runs. The trainer scores, runs its passes and updates the
policy meanwhile; the next step collects the call first, then pushes the new weights (the update lands between two
calls: in-flight responses pause after the call and resume with the new weights) and goes on as above. No group is
admitted for that call (a group admitted at step `a` only ever samples with weights of version `a` or newer: the
bound of S versions rests on it), so it carries on the groups already in flight: with S >= 1 and the default
`active_groups`, the next step's.

Departures from the papers: staleness is counted in the loop's steps, which bounds it in policy versions (a step
updates the policy at most once; during `trainer.critic_warmup` not at all), and the bound is kept by waiting for the
groups a deadline needs rather than by dropping them, so no sampled group is thrown away (torchtitan's windowed FIFO
lets a bounded window overtake the oldest group instead, and its bound grows with the window).

At `max_staleness = 0` the same loop is the synchronous schedule, and the producer builds it for every run: nothing
stays in flight, each completion ends in one call, and the rows, metrics and engine round trips are the synchronous
ones (`run`'s `at_zero`; docs/async.md, "S = 0").
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.rollout.early_rewards import EarlyRewards, row_keys, score_means
from easyrl.rollout.engine import SamplingParams
from easyrl.rollout.episode import Episode, SingleTurnEpisode, after_call, apply_step
from easyrl.rollout.loop import EngineSession, Scored, Scorer, warn_untrained
from easyrl.rollout.trajectory import (
    Trajectory,
    append_call,
    columns_from_state,
    columns_state,
    media_columns,
    request_of,
    rows_of,
)
from easyrl.seeding import call_seed, prompt_seeds


PROMPT_TENSORS = ("input_ids", "attention_mask", "position_ids")
"""The prompts' tensors; every other column is per-group data carried as it is (text, answers, rows)."""


@dataclass
class Group:
    """The `n` samples of one prompt. Sample `j`'s `c`-th engine call is seeded `call_seed(seed + j, c)`:
    fixed by the group, whatever else shares the call (and the same after a resume)."""

    prompt_ids: list[int]
    columns: dict[str, Any]
    seed: int
    samples: list[Trajectory]
    admitted_at: int = -1  # the step (batches handed over before it) that admitted it; -1 while queued
    calls: int = 0
    finished_at: int = -1  # place in the order in which groups finished; -1 while any sample runs

    def state_dict(self, episode: Episode) -> dict[str, Any]:
        """A copy: the samples' lists keep growing after a snapshot (a step undone on a stop signal restores it). Each
        sample's record holds what its episode keeps of it (`episode_state`: a tool trajectory's conversation and
        environment) and its own prompt where the chat template gave it another (`prompt_ids`)."""
        samples = []
        for sample in self.samples:
            record = sample.state_dict()
            if sample.prompt_ids != self.prompt_ids:
                record["prompt_ids"] = sample.prompt_ids
            kept = episode.state_of(sample)
            if kept is not None:
                record["episode_state"] = kept
            samples.append(record)
        return copy.deepcopy({**self.__dict__, "columns": columns_state(self.columns), "samples": samples})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        """The group of `state` (`state_dict`); its samples' episode states are the episode's to give back
        (`CarryOverLoop.load_state_dict`)."""
        prompt, columns = state["prompt_ids"], columns_from_state(state["columns"])
        samples = [Trajectory.from_state(s, prompt, columns) for s in state["samples"]]
        return cls(**{**state, "columns": columns, "samples": samples})


@dataclass
class BesideCall:
    """A call started beside the training: the responses it continues, the session it is, the sampling settings of
    its step, what it asked and when the driver started it (unix seconds)."""

    work: list[tuple[Group, int]]
    pending: Any  # the engines' call under way (`PendingRows`)
    session: int
    params: SamplingParams
    asked: SamplingParams  # what the call asked the engines
    started: float


def never_draws(count: int) -> Batch:
    """The `draw` of a loop at `max_staleness = 0`, which never draws: a step admits its own prompts only."""
    raise AssertionError(f"a loop at max_staleness = 0 asked for {count} more prompts: a step admits its own only")


def admission_room(
    admitted: int, handed_over: int, steps: int, max_staleness: int, per_step: int, active_groups: int
) -> int:
    """How many more groups may be admitted at step `steps` (batches handed over so far): while every admitted group
    fits in the steps up to `steps + max_staleness` (`admitted < (S + steps + 1) * per_step`) and fewer than
    `active_groups` are in flight."""
    by_staleness = (max_staleness + steps + 1) * per_step - admitted
    by_slots = active_groups - (admitted - handed_over)
    return max(0, min(by_staleness, by_slots))


def choose_groups(groups: list[Group], step: int, max_staleness: int, per_step: int) -> list[Group] | None:
    """The `per_step` groups that step `step` trains on, or None while it cannot yet.

    Deadlines first: the groups admitted at step `step + t - S` or before must all have trained by step `step + t`,
    which leaves at most `t * per_step` of them for the `t` steps after this one. So for t = 0 .. S this step takes
    that many more of them (all of those due now, at t = 0; among the others the ones that finished first), and is
    not ready while one of those is still running. The rest of the batch is the other groups in the order they
    finished. Taking only the due groups first is not enough: groups admitted later that finish first would keep
    overtaking the older ones, until more are due at one step than it trains on. With the admission rule the demand
    never exceeds `per_step` (docs/async.md). `groups` are in admission order."""
    chosen: list[Group] = []
    # by identity: two groups of one prompt compare equal field by field, and media columns (tensors) cannot compare
    taken = lambda g: any(g is c for c in chosen)  # noqa: E731
    for t in range(max_staleness + 1):
        layer = [g for g in groups if g.admitted_at <= step + t - max_staleness]
        more = len(layer) - t * per_step - len(chosen)  # every group chosen so far is in this layer too
        if more <= 0:
            continue
        ready = sorted((g for g in layer if g.finished_at >= 0 and not taken(g)), key=lambda g: g.finished_at)
        if len(ready) < more:
            return None
        chosen += ready[:more]
    assert len(chosen) <= per_step, f"step {step} must train {len(chosen)} groups, more than a step takes ({per_step})"
    rest = sorted((g for g in groups if g.finished_at >= 0 and not taken(g)), key=lambda g: g.finished_at)
    if len(chosen) + len(rest) < per_step:
        return None
    return chosen + rest[: per_step - len(chosen)]


class CarryOverLoop:
    """The loop above. `draw(k)` gives `k` more prompts (the trainer's sampler, each with a fresh `uid`) when the
    queue cannot fill the admission room; `engines` is how many engines a generate call is split over (a call's
    rows are padded to a multiple of it); `beside`: the engines live apart from the policy (a `BesideSession`) and
    generate while it trains."""

    def __init__(
        self,
        draw: Callable[[int], Batch],
        *,
        max_staleness: int,
        active_groups: int,
        chunk_tokens: int,
        max_response_length: int,
        stop_ids: list[int],
        pad_id: int,
        engines: int,
        scorer: Scorer | None = None,
        beside: bool = False,
        episode: Episode | None = None,
    ) -> None:
        """`scorer(rows)` scores the rows of the groups each engine call finished (as they will be handed over) on a
        thread of its own (`EarlyRewards`) while the engines go on generating; `score` hands those results back."""
        self.draw = draw
        self.early = EarlyRewards(scorer) if scorer is not None else None
        self.max_staleness = max_staleness
        self.active_groups = active_groups
        self.chunk_tokens = chunk_tokens
        self.max_len = max_response_length
        self.stop_ids = frozenset(stop_ids)
        # what follows each completion; a call cut at `chunk_tokens` with room left is a step with no observation
        self.episode: Episode = episode or SingleTurnEpisode(max_response_length)
        self.pad_id = pad_id
        self.engines = engines
        self.queue: deque[Group] = deque()  # prompts given, not admitted yet
        self.groups: list[Group] = []  # admitted, not handed over yet (admission order)
        self.steps = 0  # batches handed over
        self.admitted = 0
        self.handed_over = 0
        self.finished = 0  # groups finished so far (orders `finished_at`)
        self.last_end: float | None = None  # when the previous call ended (the window of the wait metrics)
        self.per_step: int | None = None  # groups a step trains on (the trainer's prompts per call)
        self.generates_beside = beside
        self.sessions = 0  # engine sessions opened (a call beside the training is one)
        self.beside: BesideCall | None = None  # started before the last hand-over, not collected yet
        self.beside_metrics: dict[str, float] = {}  # of a call collected between steps (`settle`), for the next one
        self.resume_metrics: dict[str, float] = {}  # how a resume rebuilt the episodes in flight, for the next step
        self.episode_s = 0.0  # the step's seconds in the episode's `after` (tools)

    # ------------------------------------------------------------------ the step
    def run(self, engines: EngineSession, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """`len(prompts)` groups of `params.n` rows to train on (they may come from earlier steps' prompts) and the
        step's timings and `async/*` metrics. At `max_staleness = 0` this is the synchronous schedule, row for row and
        metric for metric (`at_zero`)."""
        start = time.perf_counter()
        per_step = len(prompts)
        if self.max_staleness == 0:  # nothing stays in flight between synchronous steps: each call counts afresh
            self.per_step, self.steps, self.admitted, self.handed_over = None, 0, 0, 0
        if self.per_step not in (None, per_step):  # the admission counters and deadlines count in batches
            raise ValueError(
                f"the groups in flight were admitted for {self.per_step} prompts a step, this step has {per_step}: "
                "keep data.rollout_batch_size when resuming with trainer.max_staleness >= 1"
            )
        self.per_step = per_step
        self.settle()  # the call beside the last update first: its tokens precede any made with newer weights
        metrics, self.beside_metrics = self.beside_metrics, {}
        metrics |= self.resume_metrics
        self.resume_metrics = {}
        self.enqueue(prompts, params, offset=0)
        admitted = self.admit(per_step, params)
        calls, tokens, engine_s, self.episode_s = 0, 0, 0.0, 0.0
        chosen = choose_groups(self.groups, self.steps, self.max_staleness, per_step)
        # Enough groups finished in earlier sessions: no session at all this step (no wake, push or sleep); the groups
        # just admitted start at the next one, which the admission rule leaves room for.
        session_start = time.perf_counter()
        if chosen is None:
            chosen, timings, calls, tokens, engine_s = self.session(engines, per_step, params)
            metrics |= timings
        if self.max_staleness == 0:
            return self.at_zero(chosen, metrics, engine_s, params)
        session_s = time.perf_counter() - session_start
        version = engines.policy_version()  # the policy this step trains: every row's staleness is counted from it
        carried = len(self.groups) - len(chosen)
        rows = self.hand_over(chosen, params)
        if self.generates_beside:
            metrics |= self.start_beside(engines, params)
        end = time.perf_counter()
        metrics |= {
            "timing_s/generate_engine": engine_s,
            "async/engine_calls": float(calls) + metrics.get("async/beside_calls", 0.0),
            "async/generated_tokens": float(tokens) + metrics.get("async/beside_tokens", 0.0),
            "async/groups_admitted": float(admitted),
            "async/groups_carried": float(carried),
        }
        metrics |= staleness_metrics(rows, version, self.max_staleness)
        metrics |= self.episode.metrics([s for g in chosen for s in g.samples])
        metrics |= self.wait_metrics(start, end, session_s + metrics.get("async/beside_engine_s", 0.0))
        self.last_end = end
        return rows, metrics

    def one_trip(self) -> bool:
        """Whether a session is one call: at S = 0 every call ends each completion it continues (`request_for`), so
        the single-turn episode's responses all end in the first. Open, generate and close then go as one round trip
        per engine (`generate_sequences`), as the synchronous loop has always made them."""
        return self.max_staleness == 0 and isinstance(self.episode, SingleTurnEpisode)

    def session(
        self, engines: EngineSession, per_step: int, params: SamplingParams
    ) -> tuple[list[Group], dict[str, float], int, int, float]:
        """One engine session: calls until the step's groups are chosen. Returns them, the session's timings, the
        calls made, the tokens kept and the seconds the calls took."""
        one_trip = self.one_trip()
        metrics = {} if one_trip else engines.open_rollout()
        self.sessions += 1
        chosen: list[Group] | None = None
        calls, tokens, engine_s = 0, 0, 0.0
        while chosen is None:
            work = [(g, j) for g in self.groups for j, s in enumerate(g.samples) if not s.done]
            assert work, "no response left to generate, yet the step's groups are not finished"
            assert not (one_trip and calls), "a one-trip session's responses all end in its call"
            call_start = time.perf_counter()
            before = self.finished
            request, asked = self.request_for(work, params)
            if one_trip:
                out, timings = engines.generate_sequences(request, asked)
                metrics |= timings
            else:
                out = engines.generate(request, asked)
            tokens += self.record(work, out, self.sessions, asked)
            engine_s += time.perf_counter() - call_start
            calls += 1
            chosen = choose_groups(self.groups, self.steps, self.max_staleness, per_step)
            self.report_finished([g for g in self.groups if g.finished_at >= before], chosen, params)
        if not one_trip:
            metrics |= engines.close_rollout()
        return chosen, metrics, calls, tokens, engine_s

    def at_zero(
        self, chosen: list[Group], metrics: dict[str, float], engine_s: float, params: SamplingParams
    ) -> tuple[Batch, dict[str, float]]:
        """The step at S = 0, as the synchronous schedule gives it: every group of the step's own prompts, in their
        order (not the order they finished); no `async/*` metrics (nothing is carried or stale); the tool episode's
        turn and tool timings; and the log-probs dropped where the call asked for none."""
        assert len(chosen) == len(self.groups), "at S = 0 a step hands over every group it admitted"
        rows = self.hand_over(list(self.groups), params)
        if not params.logprobs:  # the engines fill zeros where none were asked for: nothing to compare against
            rows.tensors.pop("rollout_log_probs")
        if not self.one_trip():
            metrics |= {"timing_s/generate_turns": engine_s - self.episode_s, "timing_s/tools": self.episode_s}
        return rows, metrics | self.episode.metrics([s for g in chosen for s in g.samples])

    def enqueue(self, prompts: Batch, params: SamplingParams, offset: int) -> None:
        """Queue each prompt as a group, seeded from its place in this call (`prompt_seeds`, as the synchronous loop
        seeds it), after the `offset` groups the call queued before."""
        if set(prompts.tensors) - set(PROMPT_TENSORS):
            raise ValueError(
                f"trainer.max_staleness >= 1 carries the prompts' {PROMPT_TENSORS} only, this batch has tensors "
                f"{sorted(set(prompts.tensors) - set(PROMPT_TENSORS))}: give them as per-prompt columns"
            )
        assert params.seed is not None, "the trainer seeds every rollout call"
        seeds = prompt_seeds(params.seed, offset + len(prompts), params.n)[offset:].tolist()
        mask = prompts["attention_mask"].bool()
        for i in range(len(prompts)):
            prompt_ids = prompts["input_ids"][i][mask[i]].tolist()
            columns = {k: v[i] for k, v in prompts.non_tensors.items()}
            self.queue.append(
                Group(
                    prompt_ids=prompt_ids,
                    columns=columns,
                    seed=int(seeds[i]),
                    samples=[self.episode.start(prompt_ids, columns) for _ in range(params.n)],
                )
            )

    def admit(self, per_step: int, params: SamplingParams) -> int:
        """Move groups from the queue into flight as the admission rule allows, drawing prompts when the queue runs
        out; returns how many were admitted."""
        # at S = 0 a step admits its own prompts, however many (validation's, an extra attempt's): no slot limit
        slots = self.active_groups if self.max_staleness else per_step
        room = admission_room(self.admitted, self.handed_over, self.steps, self.max_staleness, per_step, slots)
        if room > len(self.queue):  # the trainer's prompts of this call are queued already: count after them
            self.enqueue(self.draw(room - len(self.queue)), params, offset=per_step)
        for _ in range(room):
            group = self.queue.popleft()
            group.admitted_at = self.steps
            self.groups.append(group)
        self.admitted += room
        return room

    def start_beside(self, engines: EngineSession, params: SamplingParams) -> dict[str, float]:
        """Start one call for the unfinished responses in flight, to run while the trainer trains (`settle` collects
        it); returns the weight push's timings."""
        work = [(g, j) for g in self.groups for j, s in enumerate(g.samples) if not s.done]
        if not work:
            return {}
        assert hasattr(engines, "generate_beside"), "beside=True needs engines of their own (a BesideSession)"
        request, asked = self.request_for(work, params)
        pushed, pending = engines.generate_beside(request, asked)
        self.sessions += 1
        self.beside = BesideCall(work, pending, self.sessions, params, asked, time.time())
        return dict(pushed)

    def settle(self) -> None:
        """Collect the call started beside the training, if any: its tokens join their responses and its finished
        groups go to `on_finished`, its metrics to the next step's (`async/beside_*`, `async/overlap_s`: the seconds
        it generated before the driver came back for it, i.e. beside the trainer's reward, passes and update)."""
        if self.beside is None:
            return
        call, self.beside = self.beside, None
        asked = time.time()
        out, timing = call.pending.result()
        waited = time.time() - asked
        timing = dict(timing)
        timing.pop("timing_s/generate_engine", None)  # the step's own engine time is the loop's figure
        start, end = timing.pop("async/beside_start_time"), timing.pop("async/beside_end_time")
        before = self.finished
        tokens = self.record(call.work, out, call.session, call.asked)
        self.report_finished([g for g in self.groups if g.finished_at >= before], None, call.params)
        self.beside_metrics |= timing | {
            "async/beside_calls": 1.0,
            "async/beside_tokens": float(tokens),
            "async/beside_engine_s": end - start,
            "async/beside_wait_s": waited,
            # the part of the call before the driver asked for it: the engines generated while the trainer worked
            "async/overlap_s": max(0.0, min(end, asked) - max(start, call.started)),
            "async/beside_start_time": start,
            "async/beside_end_time": end,
        }

    def request_for(self, work: list[tuple[Group, int]], params: SamplingParams) -> tuple[Batch, SamplingParams]:
        """The engine call for `work`: each response's prompt and tokens so far, seeded by its group and call, and what
        it asks: `chunk_tokens` tokens with log-probs; at S = 0 what the synchronous loop asks, the largest token limit
        of the responses continued (each completion ends in the call) with the log-probs `params` asks for."""
        seeds = [self.call_seed(g, j) for g, j in work]
        samples = [g.samples[j] for g, j in work]
        # a prompt with media: every call gets its media again (the engines keep nothing between calls)
        request = request_of([s.context() for s in samples], seeds, self.pad_id, self.engines, media_columns(samples))
        if self.max_staleness == 0:
            longest = max(self.episode.token_limit(s) for s in samples)
            return request, params.override({"n": 1, "max_tokens": longest})
        return request, params.override({"n": 1, "max_tokens": self.chunk_tokens, "logprobs": True})

    def call_seed(self, group: Group, j: int) -> int:
        """The seed of sample `j`'s next call (its group's `calls`-th, counted across steps and resumes), so a response
        cut into chunks or resumed from a checkpoint draws the tokens it would have drawn. The synchronous loops seed
        a row's calls alike (`seeding.call_seed`), so at `max_staleness = 0` with one call per completion this loop
        samples their trajectories."""
        # A live sample takes part in every call of its group (one restarted on a resume goes on from the group's
        # count), so at S = 0 with one call per completion `calls` is its turn: the synchronous loop's call index
        return call_seed(group.seed + j, group.calls)

    def record(self, work: list[tuple[Group, int]], out: Batch, session: int, asked: SamplingParams) -> int:
        """Append an engine call's output (the rows of `work`, then padding) to its responses, generated in engine
        session `session` with the settings `asked`; returns the tokens kept. At S = 0 each row keeps the engine's word
        on its log-probs (`rollout_logprob_mask`), as in the synchronous loop; a response continued over calls needs
        them all."""
        per_row = self.max_staleness == 0
        # at S = 0 the call's own stop ids end a completion too, as the engines stop at them (the synchronous loop)
        stop_ids = self.stop_ids | frozenset(asked.stop_token_ids) if per_row else self.stop_ids
        if not per_row and "rollout_logprob_mask" in out and not bool(out["rollout_logprob_mask"][: len(work)].all()):
            raise RuntimeError("an engine returned no log-probs for some responses: the rollout spec must ask all")
        kept = 0
        ended: list[tuple[Trajectory, bool]] = []
        valid = out["response_mask"].sum(dim=1).tolist()
        for i, (group, j) in enumerate(work):
            sample, count = group.samples[j], int(valid[i])
            by_token = count > 0 and int(out["responses"][i, count - 1]) in stop_ids
            # the last call may overrun the episode's limit (max_response_length): its tokens past it are dropped
            keep, how = after_call(sample, count, asked.max_tokens, by_token, self.episode.token_limit(sample))
            append_call(sample, out, i, keep, session, per_row_logprobs=per_row)
            if how is not None:
                sample.turns += 1
                ended.append((sample, how))
            kept += keep
        episode_start = time.perf_counter()
        for (sample, _), step in zip(ended, self.episode.after(ended, stop_ids)):
            apply_step(sample, step)
        self.episode_s += time.perf_counter() - episode_start  # the tools' share of the step (`at_zero`)
        for group in {id(g): g for g, _ in work}.values():
            group.calls += 1
            if group.finished_at < 0 and all(s.done for s in group.samples):
                group.finished_at = self.finished
                self.finished += 1
        return kept

    def report_finished(self, finished: list[Group], chosen: list[Group] | None, params: SamplingParams) -> None:
        """Hand the groups an engine call finished to `on_finished`; after the step's last call, the ones it trains on
        first (the trainer waits for their scores, while those of the groups carried over can run during the
        update)."""
        if self.early is None or not finished:
            return
        first = [g for g in finished if chosen is None or any(g is c for c in chosen)]
        later = [g for g in finished if not any(g is f for f in first)]
        for part in (first, later):
            if part:
                self.early.submit(self.group_rows(part, params))

    def hand_over(self, chosen: list[Group], params: SamplingParams) -> Batch:
        """The rows of `chosen`; they leave flight, and the step count moves on."""
        self.groups = [g for g in self.groups if not any(g is c for c in chosen)]
        self.handed_over += len(chosen)
        self.steps += 1
        return self.group_rows(chosen, params)

    def group_rows(self, chosen: list[Group], params: SamplingParams) -> Batch:
        """The rows of finished groups (sample `j` of group `i` at row `i * n + j`) with their prompts' columns."""
        samples = [s for g in chosen for s in g.samples]
        # an episode's observations may take a response past max_response_length: the rows widen to the longest. At
        # S = 0 the synchronous widths: the engines' fixed one for one-call responses, else the longest response
        longest = max(len(s.response_ids) for s in samples)
        at_zero_turns = self.max_staleness == 0 and not self.one_trip()
        rows = rows_of(samples, self.pad_id, max(1, longest) if at_zero_turns else max(self.max_len, longest))
        return rows.set(**self.episode.columns(samples))

    # ------------------------------------------------------------------ scoring
    def score(self, rows: Batch, scorer: Scorer) -> Scored:
        """The scores of `rows`: a training batch takes those its groups got when they finished (`scorer` scores the
        rest: a resumed run's groups, or a step undone on a stop signal); any other rows (validation's) are scored
        by `scorer` once the early calls are done, as the reward manager runs one batch at a time. `reward/<key>`
        over the batch, the failure counters of the calls collected, and `async/scored_early`."""
        if self.early is None:
            return scorer(rows)
        if "uid" not in rows:
            self.early.settle()
            return scorer(rows)
        early = self.early.take(row_keys(rows))
        missing = [i for i, result in enumerate(early) if result is None]
        scores = [result[0] if result is not None else {} for result in early]
        texts = [result[1] if result is not None else "" for result in early]
        counters = self.early.drain_counters()
        if missing:
            self.early.settle()  # the reward manager runs one batch at a time
            counters = {k: v + self.early.drain_counters()[k] for k, v in counters.items()}
            late_scores, late_metrics, late_texts = scorer(rows.index(missing))
            for i, score, text in zip(missing, late_scores, late_texts):
                scores[i], texts[i] = score, text
            counters = {k: v + late_metrics.get(k, 0.0) for k, v in counters.items()}
        early_share = 1.0 - len(missing) / max(1, len(rows))
        return scores, score_means(scores) | counters | {"async/scored_early": early_share}, texts

    def close(self) -> None:
        if self.early is not None:
            self.early.close()

    def wait_metrics(self, start: float, end: float, session_s: float) -> dict[str, float]:
        """Over the window since the previous call ended: how long the trainer waited for rollouts (this call), how
        long the engines waited for weights (the window less `session_s`, their generating time: this call's session
        and a call beside the training), and each side's share."""
        out = {"async/trainer_wait_s": end - start}
        if self.last_end is not None:
            window = end - self.last_end
            idle = max(0.0, window - session_s)  # a call beside the training may have started before the window
            out |= {
                "async/engine_wait_s": idle,
                "async/trainer_idle_ratio": (end - start) / window,
                "async/engine_idle_ratio": idle / window,
            }
        return out

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything in flight (JSON-able): a resumed run continues every partial response where it stopped. A call
        beside the training that was not collected is not in it (the state is the one before that call, which
        `load_state_dict` drops): `settle()` first for a state that continues it to the bit (a checkpoint). At S = 0
        nothing is in flight between steps: `{}`, a synchronous run's checkpoint."""
        if self.max_staleness == 0:
            return {}
        return {
            "max_staleness": self.max_staleness,
            "per_step": self.per_step,
            "queue": [g.state_dict(self.episode) for g in self.queue],
            "groups": [g.state_dict(self.episode) for g in self.groups],
            "steps": self.steps,
            "admitted": self.admitted,
            "handed_over": self.handed_over,
            "finished": self.finished,
            "sessions": self.sessions,
            "beside_metrics": dict(self.beside_metrics),  # a call collected for a checkpoint: the next step logs it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a step undone, or a resume): the early scores of the work since are dropped (those
        groups finish, and are scored, again). `{}`: a synchronous run's checkpoint, nothing in flight."""
        if self.early is not None:
            self.early.forget()
        self.resume_metrics = {}
        if self.max_staleness == 0:  # the synchronous schedule: an asynchronous run's groups in flight stay untrained
            warn_untrained(state)
            return
        if not state:
            return
        if state["max_staleness"] > self.max_staleness:  # a smaller bound than the groups in flight were admitted for
            raise ValueError(
                f"the checkpoint's groups in flight were admitted under trainer.max_staleness={state['max_staleness']}; "
                f"resume with at least that (got {self.max_staleness}), or with 0 to leave them untrained"
            )
        self.per_step = state["per_step"]
        self.queue = deque(Group.from_state(g) for g in state["queue"])
        self.groups = [Group.from_state(g) for g in state["groups"]]
        self.resume_episodes([*state["queue"], *state["groups"]])
        self.steps, self.admitted = int(state["steps"]), int(state["admitted"])
        self.handed_over, self.finished = int(state["handed_over"]), int(state["finished"])
        # a checkpoint from before the count: its samples' last sessions were step numbers, all below `steps`
        self.sessions = int(state.get("sessions", state["steps"]))
        self.beside = None  # started after this state: the state's own work redoes it
        self.beside_metrics = dict(state.get("beside_metrics", {}))
        self.last_end = None

    def resume_episodes(self, saved: list[dict[str, Any]]) -> None:
        """Give the restored samples of every group (queued, then in flight: `saved`'s order) what their episode
        held of them. One it cannot rebuild exactly (a tool whose replay differs) starts again from its prompt: its
        group keeps its place and deadline, and waits for it (`rollout/resume_restarts` at the next step)."""
        groups = [*self.queue, *self.groups]
        where = [(g, j) for g in groups for j in range(len(g.samples))]
        kept = [s.get("episode_state") for g in saved for s in g["samples"]]
        ok = self.episode.resume([(g.samples[j], k) for (g, j), k in zip(where, kept, strict=True)])
        for (group, j), exact in zip(where, ok, strict=True):
            if not exact:  # the group's call count goes on: the new sample's calls draw seeds no other call drew
                group.samples[j] = self.episode.start(group.prompt_ids, group.columns)
                group.finished_at = -1
        if any(k is not None for k in kept) or not all(ok):  # an episode with state of its own: a tool's
            restarts = ok.count(False)
            self.resume_metrics = {
                "rollout/resume_restarts": float(restarts),
                "rollout/resume_exact": float(len(ok) - restarts),
            }


def staleness_metrics(rows: Batch, version: int, max_staleness: int) -> dict[str, float]:
    """Over the trained tokens of `rows` (`token_policy_version`), trained at policy `version`: the share of tokens at
    each staleness 0..S (`async/staleness/<s>`), the mean and the worst; per row, how many versions its tokens span
    and the share of rows resumed in a later session than they started (partial rollouts)."""
    mask = rows["loss_mask"].bool()
    token_versions = rows["token_policy_version"]
    stale = (version - token_versions)[mask]
    out = {f"async/staleness/{s}": float((stale == s).float().mean()) for s in range(max_staleness + 1)}
    out |= {"async/staleness_mean": float(stale.float().mean()), "async/staleness_max": float(stale.max())}
    newest = torch.where(mask, token_versions, torch.iinfo(torch.int64).min).amax(dim=1)
    oldest = torch.where(mask, token_versions, torch.iinfo(torch.int64).max).amin(dim=1)
    span = (newest - oldest).clamp(min=0).float()
    out |= {"async/version_span_mean": float(span.mean()), "async/version_span_max": float(span.max())}
    out["async/resumed_fraction"] = float((rows["rollout_sessions"] > 1).float().mean())
    return out
