"""Scoring responses with the user's reward function, isolated so that it cannot stall or crash training.

Calls run in worker processes, each worker running up to ``max_concurrency`` calls at once on its own threads, so
a hung call never blocks the calls after it. A batch has one deadline, ``timeout_s`` from its start: whatever is
unfinished then (hung, or queued behind hung calls in every slot) times out, and the workers still running a call
are killed and replaced all at once. The reward stage of a step therefore ends within about ``timeout_s`` whatever
the number of hung calls. A call that raises, hangs or returns something that is not a set of finite numbers
costs only its own samples: they get ``fallback_score`` and are counted, and the first failure of each kind is
logged with the function name and an example input. As soon as more than ``max_error_ratio`` of a batch has
failed, scoring stops with :class:`RewardError` without waiting for the other calls, since a reward that is mostly
fallback would train on noise.

How calls are formed:

* ``sequential`` functions: one call per sample, spread over the workers.
* ``batch`` functions: the batch is split into ``num_workers`` chunks, one call each. A chunk whose call fails or
  times out is retried sample by sample (``[sample]`` per call, all at once, with a second deadline of
  ``timeout_s``), so one bad sample does not cost its whole chunk; a hanging sample therefore costs up to two
  timeouts of wall time.
* ``num_workers=0``: calls run on threads of the driver process, with the same deadline; the main thread only
  waits, so a stop signal is honoured at once (see :meth:`RewardManager.interrupt`). A hung call cannot be killed
  there: its thread is abandoned (a daemon thread), which is why untrusted functions belong in worker processes.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import queue
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from easyrl.config.worker import RewardConfig
from easyrl.rewards._worker import CallRunner
from easyrl.rewards.compose import load_configured_reward
from easyrl.rewards.loader import RewardFunction
from easyrl.rewards.pool import PoolTask, RewardWorkerPool, TaskFailure
from easyrl.scorers import Scorers, declared_scorers, finish_stats


__all__ = ["RewardError", "RewardManager", "make_reward_input"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # longest the driver waits between two checks of the deadline and of a stop request
_FAILURE_KINDS = ("error", "timeout", "invalid")
_COUNTER_NAMES = {"error": "reward/errors", "timeout": "reward/timeouts", "invalid": "reward/invalid"}


class RewardError(RuntimeError):
    """The reward function failed on too many samples of a batch (or cannot be used at all)."""


class _Invalid(ValueError):
    """A returned value is not a dict of finite numbers with an ``overall`` key."""


@dataclass
class _Result:
    status: str  # "ok" or one of _FAILURE_KINDS
    scores: dict[str, float] | None = None
    message: str = ""


@dataclass
class _Call:
    indices: list[int]
    mode: str  # "batch" | "each"
    retry_each: bool  # on failure of the whole call, rerun its samples one per call


def make_reward_input(
    response: str, response_length: int, ground_truth: Any, prompt: str, row: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One reward input in EasyR1's form: the row's columns plus ``prompt``, ``response``, ``response_length``
    and ``ground_truth`` (these four win over row columns of the same name)."""
    sample = dict(row or {})
    sample.update(prompt=prompt, response=response, response_length=int(response_length), ground_truth=ground_truth)
    return sample


def _as_real(value: Any) -> numbers.Real | None:
    """The number a reward returned (a Python, numpy or torch scalar), unconverted; None when it is no number."""
    if isinstance(value, numbers.Real):
        return value
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        inner = item()
        if isinstance(inner, numbers.Real):
            return inner
    return None


def _as_score(key: str, raw: numbers.Real) -> float:
    """``raw`` as a float that the float32 scores tensor can hold exactly as written; :class:`_Invalid` otherwise.

    Finiteness in float64 is not enough: ``1e39`` is finite there but overflows float32 (the dtype of the token-level
    scores and advantages), and an int beyond ~1.8e308 cannot even become a float. Every such value is invalid
    here, the one place reward values are checked, so it is counted and given the fallback score like a NaN.
    """
    try:
        number = float(raw)
    except (OverflowError, ValueError) as exc:  # a huge int or Fraction, or an odd Real subclass
        raise _Invalid(f"{key!r} cannot be represented as a float ({type(exc).__name__})") from None
    if not math.isfinite(number):
        raise _Invalid(f"{key!r} is {number}")
    try:
        # struct's float32 packing rounds as torch does and raises exactly when the rounded value would be inf.
        struct.pack("<f", number)
    except OverflowError:
        raise _Invalid(
            f"{key!r} is {number!r}, beyond the float32 range of the scores (largest 3.4028235e+38)"
        ) from None
    return number


def _normalize(value: Any) -> dict[str, float]:
    """Check one output and return it as ``{key: float}``; a bare number means ``{"overall": number}``."""
    bare = _as_real(value)
    if bare is not None:
        value = {"overall": bare}
    if not isinstance(value, Mapping):
        raise _Invalid(f"returned a {type(value).__name__}, expected a dict of numbers")
    if "overall" not in value:
        raise _Invalid(f"the result has no 'overall' key (keys: {sorted(map(str, value))})")
    scores: dict[str, float] = {}
    for key, raw in value.items():
        number = _as_real(raw)
        if number is None:
            raise _Invalid(f"{key!r} is a {type(raw).__name__}, expected a number")
        scores[str(key)] = _as_score(str(key), number)
    return scores


def _preview(sample: Any, limit: int = 800) -> str:
    """A short, readable rendering of one input for a log line."""
    if not isinstance(sample, Mapping):
        text = repr(sample)
    else:
        parts = []
        for key, value in sample.items():
            shown = repr(value)
            parts.append(f"{key!r}: {shown if len(shown) <= 160 else shown[:157] + '...'}")
        text = "{" + ", ".join(parts) + "}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split(indices: list[int], parts: int) -> list[list[int]]:
    """Contiguous, balanced chunks (no empty ones)."""
    parts = max(1, min(parts, len(indices)))
    size, extra = divmod(len(indices), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        chunks.append(indices[start:end])
        start = end
    return chunks


class RewardManager:
    """Runs the configured reward function over batches of inputs.

    Args:
        reward_cfg: ``worker.reward`` (function, kwargs, workers, timeout, fallback, error ratio, concurrency).

    Use as a context manager, or call :meth:`close`, to stop the worker processes.
    """

    def __init__(self, reward_cfg: RewardConfig) -> None:
        if not reward_cfg.reward_function:
            raise RewardError("worker.reward.reward_function is not set (expected path/to/file.py:function)")
        if reward_cfg.num_workers < 0:
            raise RewardError(f"worker.reward.num_workers must be >= 0, got {reward_cfg.num_workers}")
        self.cfg = reward_cfg
        # Scorers (a judge, a reward model) live where the calls run: built here only for in-process calls.
        self._scorers = Scorers(reward_cfg) if reward_cfg.num_workers == 0 else None
        self._scorer_names = list(declared_scorers(reward_cfg).values())
        # Imported in the driver too: a broken file fails here, before any worker starts, and REWARD_TYPE is known.
        self.reward: RewardFunction = load_configured_reward(reward_cfg, self._scorers)
        self.totals: Counter[str] = Counter()
        """Failures per kind (``error``, ``timeout``, ``invalid``) over the whole run."""
        self._logged: set[str] = set()
        self._task_ids = itertools.count()
        self._stop = threading.Event()
        self._ended_early = False
        self._pool: RewardWorkerPool | None = None
        self._runner: CallRunner | None = None
        self._done: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._abandoned = 0
        if reward_cfg.num_workers > 0:
            args = (reward_cfg,)  # each worker loads the same reward and builds its own scorers
            self._pool = RewardWorkerPool(reward_cfg.num_workers, args, max_in_flight=reward_cfg.max_concurrency)
        else:
            self._runner = CallRunner(
                self.reward.fn, self.reward.is_async, lambda *done: self._done.put(done), guard_exit=True
            )
        logger.info(
            "reward function %s (%s%s, %s)",
            self.reward.name,
            self.reward.reward_type,
            ", async" if self.reward.is_async else "",
            f"{reward_cfg.num_workers} worker processes" if self._pool else "in-process",
        )

    # ------------------------------------------------------------------ public API

    def score(self, inputs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, float]], dict[str, float]]:
        """Score ``inputs`` (see :func:`make_reward_input`) within ``timeout_s`` (twice that when a batch function's
        chunk has to be retried sample by sample).

        Returns:
            Per-sample scores (``overall`` plus the function's sub-scores; failed samples get ``fallback_score``
            for ``overall`` and for every sub-score other samples have), and metrics: ``reward/<key>`` means and
            the counters ``reward/errors``, ``reward/timeouts``, ``reward/invalid``.

        Raises:
            RewardError: more than ``max_error_ratio`` of the samples failed (raised as soon as that is known).
        """
        samples = list(inputs)
        if not samples:
            return [], {}
        if self._pool is not None:
            self._pool.wait_ready()  # the deadline starts once every worker has imported the reward file
        results: list[_Result | None] = [None] * len(samples)
        self._ended_early = False
        retries, retried_chunks = self._run_calls(self._plan(len(samples)), samples, results)
        if retries and not self._ended_early:
            self._run_calls(retries, samples, results)
        final = [result or _Result("error", message="no result") for result in results]
        return self._finish(samples, final, retried_chunks)

    def interrupt(self) -> None:
        """Ask a running (and any later) :meth:`score` to return at once; unfinished samples get the fallback and
        `max_error_ratio` is not applied. Safe to call from a signal handler."""
        self._stop.set()

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ planning and running calls

    def _plan(self, count: int) -> list[_Call]:
        indices = list(range(count))
        if self.reward.reward_type == "batch":
            workers = max(1, self.cfg.num_workers)
            return [_Call(chunk, "batch", retry_each=True) for chunk in _split(indices, workers)]
        return [_Call([i], "each", retry_each=False) for i in indices]

    def _execute(
        self, calls: list[_Call], samples: list[dict[str, Any]], on_result: Callable[[int, Any], bool]
    ) -> None:
        """Run ``calls`` until done or the deadline; ``on_result(call index, payload or TaskFailure)`` is called
        once per call, and ends the batch early by returning True."""
        deadline = time.monotonic() + self.cfg.timeout_s
        tasks = [PoolTask(next(self._task_ids), call.mode, [samples[i] for i in call.indices]) for call in calls]
        index = {task.task_id: i for i, task in enumerate(tasks)}
        handled: set[int] = set()

        def handle(task_id: int, payload: Any) -> bool:
            handled.add(task_id)
            stop = on_result(index[task_id], payload)
            self._ended_early |= stop
            return stop

        if self._pool is not None:
            payloads = self._pool.run(tasks, deadline, handle, self._stop)
        else:
            payloads = self._run_in_process(tasks, deadline, handle)
        self._ended_early |= self._stop.is_set()
        for task in tasks:
            if task.task_id not in handled:
                on_result(index[task.task_id], payloads.get(task.task_id, TaskFailure("crash", "no result")))

    def _run_in_process(
        self, tasks: list[PoolTask], deadline: float, handle: Callable[[int, Any], bool]
    ) -> dict[int, Any]:
        """The pool's `run` for ``num_workers=0``: calls on the runner's threads, this thread waiting in short slices
        so that a signal handler (and `interrupt`) takes effect at once."""
        assert self._runner is not None
        pending, payloads = deque(tasks), {}
        running: set[int] = set()
        aborted = False
        while pending or running:
            if time.monotonic() >= deadline or self._stop.is_set():
                break
            while pending and len(running) < max(1, self.cfg.max_concurrency):
                task = pending.popleft()
                running.add(task.task_id)
                self._runner.submit(task.task_id, task.mode, task.inputs)
            try:
                task_id, payload = self._done.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            if task_id in running:  # else a call abandoned in an earlier batch finished at last
                running.discard(task_id)
                payloads[task_id] = payload
                if handle(task_id, payload):
                    aborted = True
                    break
        kind = "stopped" if self._stop.is_set() or aborted else "timeout"
        for task_id in running:
            payloads[task_id] = TaskFailure(kind, f"no result by the batch deadline ({self.cfg.timeout_s:g} s)")
        for task in pending:
            payloads[task.task_id] = TaskFailure(kind, "not started by the batch deadline")
        if running and kind == "timeout":
            self._abandoned += len(running)
            logger.warning(
                "%d reward calls still run on abandoned driver threads (%d so far); num_workers: 0 cannot kill a "
                "hung call, use worker processes for a reward function that may hang",
                len(running),
                self._abandoned,
            )
        return payloads

    def _run_calls(
        self, calls: list[_Call], samples: list[dict[str, Any]], results: list[_Result | None]
    ) -> tuple[list[_Call], int]:
        """Run ``calls`` and store per-sample results; return the one-sample retries of failed whole calls and the
        number of calls that failed as a whole."""
        retries: list[_Call] = []
        failed_calls = 0

        def on_result(index: int, payload: Any) -> bool:
            nonlocal failed_calls
            call = calls[index]
            failure = self._apply(call, payload, results)
            if failure is not None and call.retry_each and len(call.indices) > 1:
                failed_calls += 1
                self._log_once(
                    "chunk",
                    "a %s call over %d samples failed (%s: %s); retrying its samples one per call",
                    self.reward.reward_type,
                    len(call.indices),
                    failure.status,
                    failure.message,
                )
                retries.extend(_Call([i], call.mode, retry_each=False) for i in call.indices)
            elif failure is not None:
                for i in call.indices:
                    results[i] = failure
            failed = sum(1 for r in results if r is not None and r.status in _FAILURE_KINDS)
            return failed > self.cfg.max_error_ratio * len(results)

        self._execute(calls, samples, on_result)
        return retries, failed_calls

    def _apply(self, call: _Call, payload: Any, results: list[_Result | None]) -> _Result | None:
        """Store the per-sample results of one call; return the failure of the call as a whole, if any."""
        if isinstance(payload, TaskFailure):
            status = {"crash": "error", "timeout": "timeout", "stopped": "unscored"}[payload.kind]
            return _Result(status, message=payload.message)
        if call.mode == "each":
            for i, (status, value) in zip(call.indices, payload):
                results[i] = self._check(value) if status == "ok" else _Result(status, message=str(value))
            return None
        status, value = payload
        if status != "ok":
            return _Result(status, message=str(value))
        if not isinstance(value, list | tuple) or len(value) != len(call.indices):
            got = f"{len(value)} results" if isinstance(value, list | tuple) else f"a {type(value).__name__}"
            hint = ""
            if isinstance(value, dict | int | float):  # written for one input, called as a batch function
                hint = (
                    " (a batch function returns a list with one result per input; for a function that scores one "
                    'input, put REWARD_TYPE = "sequential" in its file)'
                )
            return _Result("invalid", message=f"returned {got} for {len(call.indices)} inputs{hint}")
        for i, item in zip(call.indices, value):
            results[i] = self._check(item)
        return None

    @staticmethod
    def _check(value: Any) -> _Result:
        try:
            return _Result("ok", scores=_normalize(value))
        except _Invalid as exc:
            return _Result("invalid", message=str(exc))

    # ------------------------------------------------------------------ results, metrics, logging

    def _finish(
        self, samples: list[dict[str, Any]], results: list[_Result], retried_chunks: int
    ) -> tuple[list[dict[str, float]], dict[str, float]]:
        fallback = float(self.cfg.fallback_score)
        keys: dict[str, None] = {"overall": None}  # ordered set: overall first, then first-seen order
        for result in results:
            if result.scores is not None:
                keys.update(dict.fromkeys(result.scores))
        counts: Counter[str] = Counter()
        first_failure: str | None = None
        scores: list[dict[str, float]] = []
        unscored = 0  # left when the batch ended early (too many failures, or a stop request): not failures
        for sample, result in zip(samples, results):
            if result.scores is not None:
                scores.append(result.scores)
                continue
            if result.status == "unscored":
                unscored += 1
                scores.append(dict.fromkeys(keys, fallback))
                continue
            counts[result.status] += 1
            first_failure = first_failure or f"{result.status}: {result.message}"
            self._log_once(
                result.status,
                "%s (%s); the sample gets fallback_score=%s. Example input: %s",
                {"error": "raised", "timeout": "timed out", "invalid": "returned an invalid result"}[result.status],
                result.message,
                fallback,
                _preview(sample),
            )
            scores.append(dict.fromkeys(keys, fallback))
        self.totals.update(counts)
        metrics: dict[str, float] = {}
        for key in keys:
            values = [s[key] for s in scores if key in s]
            metrics[f"reward/{key}"] = sum(values) / len(values)
        for kind in _FAILURE_KINDS:
            metrics[_COUNTER_NAMES[kind]] = float(counts[kind])
        metrics["reward/retried_chunks"] = float(retried_chunks)
        if self._scorer_names:  # the judge's and reward model's calls of this batch, from wherever they ran
            calls = self._pool.drain_stats() if self._pool is not None else {}
            if self._scorers is not None:
                calls = self._scorers.drain()
            metrics |= finish_stats(calls, self._scorer_names)
        failed = sum(counts.values())
        if self._stop.is_set():
            self._log_once("interrupted", "scoring was cut short by a stop request (%d samples unscored)", unscored)
        elif failed > self.cfg.max_error_ratio * len(samples):
            early = f" before scoring stopped early ({unscored} left unscored)" if unscored else ""
            raise RewardError(
                f"reward function {self.reward.name}: {failed} of {len(samples)} samples failed{early} "
                f"({', '.join(f'{k}={v}' for k, v in counts.items())}), more than "
                f"max_error_ratio={self.cfg.max_error_ratio}; first failure: {first_failure}"
            )
        return scores, metrics

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        """Log the first occurrence of each kind of failure; later ones are only counted (batches are large)."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.warning(
            "reward function %s: " + message + " [logged once per run; later cases are counted in metrics]",
            self.reward.name,
            *args,
        )
