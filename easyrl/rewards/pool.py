"""A pool of reward worker processes serving many calls at once, with a per-batch deadline.

``concurrent.futures`` pools cannot stop one stuck call (a hung worker holds its slot for ever), so this pool talks
to each worker over its own pipe and knows which tasks each worker runs. A worker runs up to ``max_in_flight``
tasks at once on its own threads (see :mod:`easyrl.rewards._worker`), so a hung call does not block the calls
after it. :meth:`RewardWorkerPool.run` ends by the batch deadline whatever the number of hung calls: tasks not
finished by then are reported as timed out, and every worker still holding one is killed and replaced, all of them
at once (kill first, then wait, then start the replacements). A worker that dies takes its in-flight tasks with
it; each of those is run once more alone on a worker, so a call that crashes its process costs only its own
samples. Workers are started with the ``forkserver`` method where available (a fresh, thread-free parent, and
fast replacements since the worker module is preloaded in the server), else ``spawn``; never plain ``fork``, which
is unsafe in a process that holds CUDA contexts or threads.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any


__all__ = ["PoolTask", "RewardWorkerPool", "TaskFailure", "WorkerStartError"]

logger = logging.getLogger(__name__)

_WORKER_MODULE = "easyrl.rewards._worker"
_STARTUP_TIMEOUT_S = 300.0  # importing a reward file may load a judge model or a large library
_MAX_START_FAILURES = 3  # consecutive workers dying before "ready": the reward file itself is broken
_POLL_S = 0.1  # longest wait between two checks of the deadline and of a stop request


class WorkerStartError(RuntimeError):
    """Reward workers cannot start (the reward file fails to import in a worker, or workers keep dying)."""


@dataclass
class PoolTask:
    """One call to run in a worker."""

    task_id: int
    mode: str
    """``batch`` or ``each`` (see :mod:`easyrl.rewards._worker`)."""
    inputs: list[Any]
    alone: bool = False
    """Run with no other task on its worker (a retry after a worker died with it in flight)."""


@dataclass
class TaskFailure:
    """The task produced no payload: ``kind`` is ``timeout``, ``crash`` or ``stopped`` (the caller ended the batch
    early: too many failures, or the run was asked to stop)."""

    kind: str
    message: str


@dataclass
class _Slot:
    process: Any = None
    conn: Any = None
    ready: bool = False
    started_at: float = 0.0
    tasks: dict[int, PoolTask] = field(default_factory=dict)
    replaced: int = 0

    def busy_alone(self) -> bool:
        return any(task.alone for task in self.tasks.values())


def _context() -> Any:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # '__main__' is the default preload; keep it (children would re-import it otherwise) and add the worker.
        ctx.set_forkserver_preload(["__main__", _WORKER_MODULE])
        return ctx
    return multiprocessing.get_context("spawn")


class RewardWorkerPool:
    """``num_workers`` processes, each importing the reward file named by ``spec`` and serving tasks.

    Args:
        num_workers: worker processes (>= 1).
        worker_args: arguments of :func:`easyrl.rewards._worker.worker_main` after the connection and the environment.
        max_in_flight: tasks a worker runs at once.
    """

    def __init__(self, num_workers: int, worker_args: tuple[Any, ...], max_in_flight: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._ctx = _context()
        self._worker_args = worker_args
        self._max_in_flight = max(1, max_in_flight)
        self._slots = [_Slot() for _ in range(num_workers)]
        self._start_failures = 0
        self._closed = False
        self._stats: dict[str, float] = {}
        for slot in self._slots:
            self._start(slot)

    def drain_stats(self) -> dict[str, float]:
        """The scorers' call counters the workers sent with their results since the last drain (summed)."""
        stats, self._stats = self._stats, {}
        return stats

    # ------------------------------------------------------------------ process management

    def _start(self, slot: _Slot) -> None:
        from easyrl.rewards._worker import worker_main

        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        # A forkserver child inherits the environment of the server, frozen when the first pool started it; send
        # this process's environment now, so a variable set since (a judge's key, a sandbox URL) reaches the worker.
        environ = dict(os.environ)
        process = self._ctx.Process(
            target=worker_main,
            args=(child_conn, environ, *self._worker_args),
            daemon=True,
            name="easyrl-reward-worker",
        )
        process.start()
        child_conn.close()  # the parent keeps only its end, so EOF is seen when the worker dies
        slot.process, slot.conn, slot.ready, slot.tasks = process, parent_conn, False, {}
        slot.started_at = time.monotonic()

    def _replace_all(self, slots: list[_Slot]) -> None:
        """Kill every worker of `slots` first, then reap them, then start the replacements: the cost is one
        kill-and-start, not one per worker."""
        for slot in slots:
            if slot.process is not None and slot.process.is_alive():
                slot.process.kill()
        for slot in slots:
            if slot.process is not None:
                slot.process.join(timeout=5)  # reap it (no zombie)
            if slot.conn is not None:
                slot.conn.close()
            slot.process = slot.conn = None
            slot.replaced += 1
        for slot in slots:
            self._start(slot)

    @property
    def num_replaced(self) -> int:
        """Workers replaced so far (killed for a timeout, or died)."""
        return sum(slot.replaced for slot in self._slots)

    # ------------------------------------------------------------------ running

    def wait_ready(self) -> None:
        """Block until every worker has imported the reward file (raises WorkerStartError if one cannot)."""
        while not self._closed and not all(slot.ready for slot in self._slots):
            now = time.monotonic()
            late = [slot for slot in self._slots if not slot.ready and now >= slot.started_at + _STARTUP_TIMEOUT_S]
            if late:
                self.close()
                raise WorkerStartError(f"a reward worker did not become ready within {_STARTUP_TIMEOUT_S:g} s")
            self._wait_and_collect({}, deque(), _POLL_S)  # reads the workers' "ready" (or notices a death)

    def run(
        self,
        tasks: list[PoolTask],
        deadline: float,
        on_result: Callable[[int, Any], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> dict[int, Any]:
        """Run ``tasks`` until they are done or ``deadline`` (``time.monotonic()``) passes; return ``task_id ->
        payload`` (or a :class:`TaskFailure`) for every task. ``on_result(task_id, payload)`` returning True, or
        ``stop`` being set, ends the batch at once (the remaining tasks fail as ``stopped``)."""
        if self._closed:
            raise RuntimeError("the reward worker pool is closed")
        pending = deque(tasks)
        results: dict[int, Any] = {}
        budget_s = deadline - time.monotonic()
        seen = 0
        ended = ""
        while pending or any(slot.tasks for slot in self._slots):
            if time.monotonic() >= deadline:
                ended = "timeout"
                break
            if stop is not None and stop.is_set():
                ended = "stopped"
                break
            for slot in self._slots:
                self._dispatch(slot, pending)
            # Never past the deadline, nor longer than a poll: the stop event is checked between waits.
            self._wait_and_collect(results, pending, min(_POLL_S, max(0.0, deadline - time.monotonic())))
            new = list(results)[seen:]  # dicts keep insertion order: the entries past `seen` came this round
            seen = len(results)
            if on_result is not None and any(on_result(task_id, results[task_id]) for task_id in new):
                ended = "stopped"
                break
        self._end_batch(results, pending, ended, budget_s)
        return results

    def _end_batch(self, results: dict[int, Any], pending: deque[PoolTask], ended: str, budget_s: float) -> None:
        """Fail whatever is unfinished and replace, all at once, the workers still running something."""
        if ended == "timeout":
            running = TaskFailure("timeout", f"no result by the batch deadline ({budget_s:.3g} s)")
            queued = TaskFailure("timeout", "not started by the batch deadline: hung calls held every worker slot")
        else:
            running = queued = TaskFailure("stopped", "not finished: the batch was ended early")
        for task in pending:
            results[task.task_id] = queued
        busy = [slot for slot in self._slots if slot.tasks]
        for slot in busy:
            for task_id in slot.tasks:
                results[task_id] = running
        if busy:
            logger.info("replacing %d reward worker(s) that still run a call at the end of the batch", len(busy))
            # A sync call cannot be interrupted from outside; the only way to free the worker is a new process.
            # Whether the batch timed out or was ended early: a call left running would hold its slot into the next
            # batch, and its late result would arrive there under a task id that batch does not know.
            self._replace_all(busy)

    def _dispatch(self, slot: _Slot, pending: deque[PoolTask]) -> None:
        while pending and slot.ready and not slot.busy_alone() and len(slot.tasks) < self._max_in_flight:
            task = pending[0]
            # A task that must run alone waits at the head of the queue for an idle worker.
            if task.alone and slot.tasks:
                return
            pending.popleft()
            try:
                slot.conn.send(("task", task.task_id, task.mode, task.inputs))
            except (BrokenPipeError, EOFError, OSError):
                # The worker died; this task never started, so it goes back to the queue.
                pending.appendleft(task)
                self._on_death(slot, {}, pending)
                return
            slot.tasks[task.task_id] = task
            if task.alone:  # nothing else joins it on this worker
                return

    def _wait_and_collect(self, results: dict[int, Any], pending: deque[PoolTask], timeout: float) -> None:
        handles: dict[Any, _Slot] = {}
        for slot in self._slots:
            handles[slot.conn] = slot
            handles[slot.process.sentinel] = slot  # ready once the process exits, message or not
        for handle in connection.wait(list(handles), timeout=timeout):
            slot = handles[handle]
            if handle is not slot.conn and handle is not getattr(slot.process, "sentinel", None):
                continue  # the slot was replaced while handling an earlier handle of this round
            self._service(slot, results, pending)

    def _service(self, slot: _Slot, results: dict[int, Any], pending: deque[PoolTask]) -> None:
        """Read everything the worker sent, or handle its death."""
        try:
            while slot.conn.poll():  # drain without blocking
                message = slot.conn.recv()
                kind = message[0]
                if kind == "ready":
                    slot.ready = True
                    self._start_failures = 0
                elif kind == "load_error":
                    self.close()
                    raise WorkerStartError(f"a reward worker cannot load the reward function: {message[1]}")
                elif kind == "result" and message[1] in slot.tasks:
                    del slot.tasks[message[1]]
                    results[message[1]] = message[2]
                    for key, value in message[3].items():  # the scorers' calls made for this task
                        self._stats[key] = self._stats.get(key, 0.0) + value
            if slot.process.is_alive():
                return
        except (EOFError, OSError):
            pass
        self._on_death(slot, results, pending)

    def _on_death(self, slot: _Slot, results: dict[int, Any], pending: deque[PoolTask]) -> None:
        code = slot.process.exitcode if slot.process is not None else None
        for task in slot.tasks.values():
            if task.alone:  # it ran alone: this task killed the process
                results[task.task_id] = TaskFailure("crash", f"the reward worker process died (exit code {code})")
            else:  # one of the tasks in flight killed it: run each again alone to find which
                pending.append(PoolTask(task.task_id, task.mode, task.inputs, alone=True))
        slot.tasks = {}
        if not slot.ready:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self.close()
                raise WorkerStartError(
                    f"reward workers keep dying before they are ready (last exit code {code}); "
                    "check that the reward file imports cleanly in a fresh process"
                )
        logger.warning("a reward worker process died (exit code %s); starting a replacement", code)
        self._replace_all([slot])

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop all workers (politely, then by force)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot.conn is not None and not slot.tasks:
                with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                    slot.conn.send(("stop",))
        deadline = time.monotonic() + 2.0  # one grace for all the workers, not 2 s each
        for slot in self._slots:
            if slot.process is not None:
                slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                slot.process.kill()
            if slot.process is not None:
                slot.process.join(timeout=5)
            if slot.conn is not None:
                slot.conn.close()
            slot.process = slot.conn = None
