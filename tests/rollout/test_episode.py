"""Episodes and the one trajectory record (`easyrl.rollout.episode`, `easyrl.rollout.trajectory`): how an engine call
ends a completion under an episode's limit (a carry-over chunk with room left is a step with no observation), what
an episode's answer does to the record, and the rows every schedule builds from it."""

from __future__ import annotations

import torch

from easyrl.rollout.episode import Continue, SingleTurnEpisode, Stop, after_call, apply_step
from easyrl.rollout.trajectory import Trajectory, append_call, request_of, rows_of
from easyrl.seeding import SEED_COLUMN


def _sampled(tokens: list[int], version: int = 3) -> Trajectory:
    traj = Trajectory([7, 8], {"uid": "p0"})
    traj.append(tokens, trained=True, log_probs=[-0.5] * len(tokens), version=version)
    traj.record_call(session=1, version=version, has_logprobs=None)
    return traj


def test_a_call_ends_a_completion_by_a_stop_by_the_limit_or_not_at_all() -> None:
    traj = _sampled([1, 2])  # 2 tokens of this completion so far, the episode allows 6
    assert after_call(traj, count=3, max_tokens=4, stopped_by_token=False, limit=6) == (3, True)  # fewer than asked
    assert after_call(traj, count=4, max_tokens=4, stopped_by_token=True, limit=6) == (4, True)  # a stop token last
    assert after_call(traj, count=4, max_tokens=4, stopped_by_token=False, limit=6) == (4, False)  # the limit, exactly
    assert after_call(traj, count=4, max_tokens=4, stopped_by_token=True, limit=5) == (3, False)  # cut past the limit
    # a chunk cut by the schedule with room left: the completion goes on at the next call, no observation, no turn
    assert after_call(traj, count=2, max_tokens=2, stopped_by_token=False, limit=6) == (2, None)
    # after an observation the limit counts from the completion's start, not from the prompt
    apply_step(traj, Continue([50, 51, 52]))
    assert (
        traj.completion() == [] and after_call(traj, count=4, max_tokens=4, stopped_by_token=False, limit=6)[1] is None
    )


def test_an_episodes_answer_appends_observations_untrained_or_ends_the_trajectory() -> None:
    traj = _sampled([1, 2, 3])
    apply_step(traj, Continue([50, 51]))
    assert traj.response_ids == [1, 2, 3, 50, 51] and traj.loss_mask == [1, 1, 1, 0, 0]
    assert traj.log_probs == [-0.5, -0.5, -0.5, 0.0, 0.0] and traj.versions == [3] * 5  # the completion's version
    assert traj.completion_start == 5 and not traj.done
    apply_step(traj, Continue([], prompt=[9, 9, 9]))  # the template rewrote the history: a new sample
    assert (traj.prompt_ids, traj.response_ids, traj.call_versions) == ([9, 9, 9], [], [3])
    apply_step(traj, Stop("budget", [60]))
    assert traj.done and traj.stop_reason == "budget" and traj.response_ids == [60] and traj.loss_mask == [0]
    # the single-turn episode stops every completion that ends, saying how
    ended = [(_sampled([1]), True), (_sampled([1]), False)]
    assert SingleTurnEpisode(8).after(ended, frozenset()) == [Stop("stop"), Stop("length")]


def test_rows_keep_the_engines_contract_for_every_schedule() -> None:
    a, b = _sampled([1, 2, 3], version=2), _sampled([4], version=3)
    apply_step(a, Continue([50]))
    a.append([5], trained=True, log_probs=[-1.0], version=4)
    a.record_call(session=2, version=4, has_logprobs=None)
    rows = rows_of([a, b], pad_id=0, width=6)
    assert rows["responses"].tolist() == [[1, 2, 3, 50, 5, 0], [4, 0, 0, 0, 0, 0]]
    assert rows["response_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert rows["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert rows["token_policy_version"].tolist() == [[2, 2, 2, 2, 4, -1], [3, -1, -1, -1, -1, -1]]
    assert rows["policy_version"].tolist() == [2, 3] and rows["rollout_sessions"].tolist() == [2, 1]
    assert rows["input_ids"][0].tolist() == [7, 8, 1, 2, 3, 50, 5, 0] and rows["uid"] == ["p0", "p0"]
    assert rows["position_ids"][1].tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    assert "rollout_logprob_mask" not in rows  # no engine said which rows have log-probs


def test_a_request_is_left_padded_seeded_and_split_evenly_and_a_call_appends_its_row() -> None:
    request = request_of([[5, 6, 7], [8]], seeds=[11, 12], pad_id=0, engines=4)
    assert request["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 8], [0, 0, 8]]
    assert request["attention_mask"].tolist()[1] == [0, 0, 1] and request[SEED_COLUMN].tolist() == [11, 12, 12, 12]
    out = request.set(
        responses=torch.tensor([[9, 10, 0], [3, 0, 0], [3, 0, 0], [3, 0, 0]]),
        rollout_log_probs=torch.full((4, 3), -0.25),
        policy_version=torch.tensor([5, 5, 5, 5]),
        rollout_logprob_mask=torch.tensor([True, False, False, False]),
    )
    traj = Trajectory([5, 6, 7])
    append_call(traj, out, row=0, keep=2, session=4, per_row_logprobs=True)
    assert (traj.response_ids, traj.log_probs, traj.versions) == ([9, 10], [-0.25, -0.25], [5, 5])
    assert (traj.call_versions, traj.logprob_rows, traj.sessions) == ([5], [True], 1)
