"""Scoring responses with the user's reward function, isolated so that it cannot stall or crash training.

Each call runs in a worker process with a deadline. A call that raises, hangs or returns something that is not a
set of finite numbers costs only its own samples: they get ``fallback_score`` and are counted, and the first
failure of each kind is logged with the function name and an example input. Only when more than
``max_error_ratio`` of a batch fails does scoring stop with :class:`RewardError`, since a reward that is mostly
fallback would train on noise.

How calls are formed:

* ``sequential`` functions: one call per sample, spread over the workers; a hung call blocks one worker until its
  deadline while the others continue. Async ones get one chunk per worker, run concurrently inside it (at most
  ``max_concurrency`` at a time, ``timeout_s`` each).
* ``batch`` functions: the batch is split into ``num_workers`` chunks, one call each. A chunk whose call fails or
  times out is retried sample by sample (``[sample]`` per call), so one bad sample does not cost its whole chunk;
  a hanging sample therefore costs up to two timeouts of wall time.
* ``num_workers=0``: calls run in the driver process; there is no isolation and sync calls have no timeout.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from easyrl.config.worker import RewardConfig
from easyrl.rewards._worker import run_task
from easyrl.rewards.loader import RewardFunction, load_reward_function
from easyrl.rewards.pool import PoolTask, RewardWorkerPool, TaskFailure


__all__ = ["RewardError", "RewardManager", "make_reward_input"]

logger = logging.getLogger(__name__)

_ASYNC_GRACE_S = 2.0  # slack on top of in-worker async timeouts before the process itself is killed
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
    time_limit_s: float
    retry_each: bool  # on failure of the whole call, rerun its samples one per call


def make_reward_input(
    response: str, response_length: int, ground_truth: Any, prompt: str, row: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One reward input in EasyR1's form: the row's columns plus ``prompt``, ``response``, ``response_length``
    and ``ground_truth`` (these four win over row columns of the same name)."""
    sample = dict(row or {})
    sample.update(prompt=prompt, response=response, response_length=int(response_length), ground_truth=ground_truth)
    return sample


def _as_number(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        inner = item()
        if isinstance(inner, numbers.Real):
            return float(inner)
    return None


def _normalize(value: Any) -> dict[str, float]:
    """Check one output and return it as ``{key: float}``; a bare number means ``{"overall": number}``."""
    number = _as_number(value)
    if number is not None:
        value = {"overall": number}
    if not isinstance(value, Mapping):
        raise _Invalid(f"returned a {type(value).__name__}, expected a dict of numbers")
    if "overall" not in value:
        raise _Invalid(f"the result has no 'overall' key (keys: {sorted(map(str, value))})")
    scores: dict[str, float] = {}
    for key, raw in value.items():
        number = _as_number(raw)
        if number is None:
            raise _Invalid(f"{key!r} is a {type(raw).__name__}, expected a number")
        if not math.isfinite(number):
            raise _Invalid(f"{key!r} is {number}")
        scores[str(key)] = number
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
        # Imported in the driver too: a broken file fails here, before any worker starts, and REWARD_TYPE is known.
        self.reward: RewardFunction = load_reward_function(
            reward_cfg.reward_function, reward_cfg.reward_function_kwargs, reward_cfg.reward_type
        )
        self.totals: Counter[str] = Counter()
        """Failures per kind (``error``, ``timeout``, ``invalid``) over the whole run."""
        self._logged: set[str] = set()
        self._task_ids = itertools.count()
        self._pool: RewardWorkerPool | None = None
        if reward_cfg.num_workers > 0:
            spec = f"{self.reward.path}:{self.reward.function_name}"
            args = (
                spec,
                self.reward.kwargs,
                self.reward.reward_type,
                reward_cfg.max_concurrency,
                reward_cfg.timeout_s,
            )
            self._pool = RewardWorkerPool(reward_cfg.num_workers, args)
        logger.info(
            "reward function %s (%s%s, %s)",
            self.reward.name,
            self.reward.reward_type,
            ", async" if self.reward.is_async else "",
            f"{reward_cfg.num_workers} worker processes" if self._pool else "in-process",
        )

    # ------------------------------------------------------------------ public API

    def score(self, inputs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, float]], dict[str, float]]:
        """Score ``inputs`` (see :func:`make_reward_input`).

        Returns:
            Per-sample scores (``overall`` plus the function's sub-scores; failed samples get ``fallback_score``
            for ``overall`` and for every sub-score other samples have), and metrics: ``reward/<key>`` means and
            the counters ``reward/errors``, ``reward/timeouts``, ``reward/invalid``.

        Raises:
            RewardError: more than ``max_error_ratio`` of the samples failed.
        """
        samples = list(inputs)
        if not samples:
            return [], {}
        results: list[_Result | None] = [None] * len(samples)
        retries, retried_chunks = self._run_calls(self._plan(len(samples)), samples, results)
        if retries:
            self._run_calls(retries, samples, results)
        final = [result or _Result("error", message="no result") for result in results]
        return self._finish(samples, final, retried_chunks)

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
        cfg, indices = self.cfg, list(range(count))
        workers = max(1, cfg.num_workers)
        if self.reward.reward_type == "batch":
            return [_Call(chunk, "batch", cfg.timeout_s, retry_each=True) for chunk in _split(indices, workers)]
        if self.reward.is_async:
            calls = []
            for chunk in _split(indices, workers):
                # Inside the worker each call has timeout_s; the process deadline covers the queued rounds.
                rounds = math.ceil(len(chunk) / max(1, cfg.max_concurrency))
                calls.append(_Call(chunk, "each", rounds * cfg.timeout_s + _ASYNC_GRACE_S, retry_each=True))
            return calls
        return [_Call([i], "each", cfg.timeout_s, retry_each=False) for i in indices]

    def _execute(self, calls: list[_Call], samples: list[dict[str, Any]]) -> list[Any]:
        """Payload (or :class:`TaskFailure`) of each call, in order."""
        cfg = self.cfg
        if self._pool is None:
            return [
                run_task(
                    self.reward.fn,
                    self.reward.is_async,
                    call.mode,
                    [samples[i] for i in call.indices],
                    cfg.max_concurrency,
                    cfg.timeout_s,
                )
                for call in calls
            ]
        tasks = [
            PoolTask(next(self._task_ids), call.mode, [samples[i] for i in call.indices], call.time_limit_s)
            for call in calls
        ]
        payloads = self._pool.run(tasks)
        return [payloads.get(task.task_id, TaskFailure("crash", "no result")) for task in tasks]

    def _run_calls(
        self, calls: list[_Call], samples: list[dict[str, Any]], results: list[_Result | None]
    ) -> tuple[list[_Call], int]:
        """Run ``calls`` and store per-sample results; return the one-sample retries of failed whole calls and the
        number of calls that failed as a whole."""
        retries: list[_Call] = []
        failed_calls = 0
        for call, payload in zip(calls, self._execute(calls, samples)):
            failure = self._apply(call, payload, results)
            if failure is None:
                continue
            if call.retry_each and len(call.indices) > 1:
                failed_calls += 1
                self._log_once(
                    "chunk",
                    "a %s call over %d samples failed (%s: %s); retrying its samples one per call",
                    self.reward.reward_type,
                    len(call.indices),
                    failure.status,
                    failure.message,
                )
                limit = self.cfg.timeout_s + (_ASYNC_GRACE_S if call.mode == "each" else 0.0)
                retries.extend(_Call([i], call.mode, limit, retry_each=False) for i in call.indices)
            else:
                for i in call.indices:
                    results[i] = failure
        return retries, failed_calls

    def _apply(self, call: _Call, payload: Any, results: list[_Result | None]) -> _Result | None:
        """Store the per-sample results of one call; return the failure of the call as a whole, if any."""
        if isinstance(payload, TaskFailure):
            return _Result("timeout" if payload.kind == "timeout" else "error", message=payload.message)
        if call.mode == "each":
            for i, (status, value) in zip(call.indices, payload):
                results[i] = self._check(value) if status == "ok" else _Result(status, message=str(value))
            return None
        status, value = payload
        if status != "ok":
            return _Result(status, message=str(value))
        if not isinstance(value, list | tuple) or len(value) != len(call.indices):
            got = f"{len(value)} results" if isinstance(value, list | tuple) else f"a {type(value).__name__}"
            return _Result("invalid", message=f"returned {got} for {len(call.indices)} inputs")
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
        for sample, result in zip(samples, results):
            if result.scores is not None:
                scores.append(result.scores)
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
        failed = sum(counts.values())
        if failed > self.cfg.max_error_ratio * len(samples):
            raise RewardError(
                f"reward function {self.reward.name}: {failed} of {len(samples)} samples failed "
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
