"""Scoring finished groups beside the engines (`easyrl.rollout.early_rewards`): results come back under the row they
were scored for, whatever shares the call, one batch at a time, and errors surface on the driver's thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from easyrl.batch import Batch
from easyrl.rollout.early_rewards import EarlyRewards, Scored, row_keys, score_means


def _rows(uids: list[str], lengths: list[int]) -> Batch:
    return Batch({"length": torch.tensor(lengths)}, {"uid": uids})


def test_row_keys_number_the_samples_of_each_group() -> None:
    assert row_keys(_rows(["a", "a", "b", "a"], [1, 2, 3, 4])) == [("a", 0), ("a", 1), ("b", 0), ("a", 2)]


def test_score_means_match_the_reward_managers_batch_means() -> None:
    scores = [{"overall": 1.0, "acc": 1.0}, {"overall": 0.0}, {"overall": 0.5, "acc": 0.0}]
    assert score_means(scores) == {"reward/overall": 0.5, "reward/acc": 0.5}
    assert list(score_means([{"acc": 1.0, "overall": 0.0}])) == ["reward/overall", "reward/acc"]


def test_early_results_come_back_per_row_one_call_at_a_time() -> None:
    running, overlapped = [], []

    def score(rows: Batch) -> Scored:
        overlapped.append(bool(running))
        running.append(threading.get_ident())
        time.sleep(0.05)
        running.pop()
        lengths = rows["length"].tolist()
        metrics = {"reward/errors": 1.0, "reward/timeouts": 0.0}
        return [{"overall": float(n)} for n in lengths], metrics, [f"text{n}" for n in lengths]

    early = EarlyRewards(score)
    try:
        early.submit(_rows(["g1", "g1"], [3, 4]))
        early.submit(_rows(["g2", "g2"], [5, 6]))
        early.settle()
        assert overlapped == [False, False]  # the manager never runs two batches at once
        # the batch handed over later orders its rows differently; a row never scored early gets None
        got = early.take([("g2", 1), ("g1", 0), ("g3", 0), ("g1", 1)])
        assert got == [({"overall": 6.0}, "text6"), ({"overall": 3.0}, "text3"), None, ({"overall": 4.0}, "text4")]
        assert early.take([("g1", 0)]) == [None]  # taken once
        assert early.drain_counters()["reward/errors"] == 2.0
        assert early.drain_counters()["reward/errors"] == 0.0
    finally:
        early.close()


def test_a_reward_error_in_the_background_surfaces_when_the_driver_settles() -> None:
    def failing(rows: Batch) -> Scored:
        raise RuntimeError("reward function failed on too many samples")

    early = EarlyRewards(failing)
    try:
        early.submit(_rows(["g"], [1]))
        with pytest.raises(RuntimeError, match="too many samples"):
            early.settle()
        early.submit(_rows(["g"], [1]))
        early.forget()  # an undone step's scoring: waited for, its error dropped
        assert early.take([("g", 0)]) == [None]
    finally:
        early.close()


def test_a_step_waits_only_for_the_calls_holding_its_rows() -> None:
    """The groups a step carries over are scored after the ones it trains on, during its update: taking the first
    call's rows does not wait for the second call."""
    release, later_done = threading.Event(), threading.Event()

    def score(rows: Batch) -> Scored:
        if rows["uid"][0] == "later":
            release.wait(timeout=5)
            later_done.set()
        return [{"overall": 1.0}] * len(rows), {}, [""] * len(rows)

    early = EarlyRewards(score)
    try:
        early.submit(_rows(["now"], [1]))
        early.submit(_rows(["later"], [1]))
        assert early.take([("now", 0)]) == [({"overall": 1.0}, "")]
        assert not later_done.is_set()  # taken while the second call still ran
        release.set()
        assert early.take([("later", 0)]) == [({"overall": 1.0}, "")]
    finally:
        early.close()
