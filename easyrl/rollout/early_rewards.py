"""Scoring responses while the engines still generate (asynchronous rollouts, `trainer.max_staleness` >= 1).

The carry-over loop reports each engine call's newly finished groups; they are scored
on one thread beside the engines, and the step's reward stage takes their scores instead of calling the reward
function again, scoring on the spot only what was not scored early (after a resume, say). A slow reward then runs
while the engines generate rather than after them. The reward manager runs one batch at a time (its deadline and
error ratio are per batch), so every reward call on the driver first waits for the early ones (`settle`): two
batches never run at once. The step's reward stage waits only for the calls holding its rows, and the loop submits the
groups a step trains on before those it carries over, whose scoring then runs during the update.

What changes against scoring the handed-over batch: `reward/<key>` are the same means over the step's samples; the
failure counters (`reward/errors`, `timeouts`, `invalid`, `retried_chunks`) count the calls the step collected, which
may include groups that train later; the error ratio applies to each early call's groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from easyrl.batch import Batch
from easyrl.rollout.loop import Scored


__all__ = ["COUNTERS", "EarlyRewards", "Scored", "row_keys", "score_means"]

COUNTERS = ("reward/errors", "reward/timeouts", "reward/invalid", "reward/retried_chunks")


def row_keys(rows: Batch) -> list[tuple[str, int]]:
    """(group id, sample index within its group) of each row: the same in a finished group's rows and in the batch
    handed over later, whatever else shares either."""
    seen: Counter[str] = Counter()
    keys = []
    for uid in rows["uid"]:
        keys.append((uid, seen[uid]))
        seen[uid] += 1
    return keys


def score_means(scores: list[dict[str, float]]) -> dict[str, float]:
    """`reward/<key>`: the mean of each score key over the samples that have it, `overall` first (as the reward
    manager reports a batch)."""
    keys = dict.fromkeys(["overall", *(k for s in scores for k in s)])
    out = {}
    for key in keys:
        values = [s[key] for s in scores if key in s]
        if values:
            out[f"reward/{key}"] = sum(values) / len(values)
    return out


class EarlyRewards:
    """Scores rows on one background thread as they are submitted; `take` hands back those of a batch."""

    def __init__(self, score_rows: Callable[[Batch], Scored]) -> None:
        self.score_rows = score_rows
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="easyrl-early-reward")
        self.calls: list[tuple[Future[Scored], list[tuple[str, int]]]] = []  # in submission order
        self.ready: dict[tuple[str, int], tuple[dict[str, float], str]] = {}
        self.counters: Counter[str] = Counter()

    def submit(self, rows: Batch) -> None:
        """Score `rows` (whole finished groups, with their prompts' columns) in the background."""
        self.calls.append((self.pool.submit(self.score_rows, rows), row_keys(rows)))

    def settle(self, keys: list[tuple[str, int]] | None = None) -> None:
        """Wait for the calls submitted (those up to the last one holding one of `keys`, or all) and keep their
        results; a reward error raised there surfaces here."""
        wanted = set(keys) if keys is not None else None
        last = max((i for i, (_, held) in enumerate(self.calls) if wanted is None or wanted & set(held)), default=-1)
        done, self.calls = self.calls[: last + 1], self.calls[last + 1 :]
        for future, held in done:
            scores, metrics, texts = future.result()
            self.ready |= {key: (score, text) for key, score, text in zip(held, scores, texts)}
            self.counters.update({k: metrics.get(k, 0.0) for k in COUNTERS})

    def take(self, keys: list[tuple[str, int]]) -> list[tuple[dict[str, float], str] | None]:
        """The early result of each row (None where there is none), once the calls holding them are done; they leave
        the store. Calls submitted after those may still run (the next step's groups)."""
        self.settle(keys)
        return [self.ready.pop(key, None) for key in keys]

    def drain_counters(self) -> dict[str, float]:
        """The failure counters of the early calls since the last drain."""
        out = {k: float(self.counters[k]) for k in COUNTERS}
        self.counters.clear()
        return out

    def forget(self) -> None:
        """Drop every result (a step was undone: the groups it finished are finished again, and scored again); the
        calls still running are waited for, their results and errors dropped."""
        calls, self.calls = self.calls, []
        for future, _ in calls:
            future.exception()  # waits; an error of an undone step's scoring is not this run's to raise
        self.ready.clear()
        self.counters.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
