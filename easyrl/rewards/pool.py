"""A pool of reward worker processes with a per-task deadline; a task past its deadline gets its worker killed.

``concurrent.futures`` pools cannot stop one stuck call (a hung worker holds its slot for ever), so this pool talks
to each worker over its own pipe, knows which task each worker runs and since when, and replaces a worker that
overruns or dies. Workers are started with the ``forkserver`` method where available (a fresh, thread-free parent,
and fast replacements since the worker module is preloaded in the server), else ``spawn``; never plain ``fork``,
which is unsafe in a process that holds CUDA contexts or threads.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any


__all__ = ["PoolTask", "RewardWorkerPool", "WorkerStartError"]

logger = logging.getLogger(__name__)

_WORKER_MODULE = "easyrl.rewards._worker"
_STARTUP_TIMEOUT_S = 300.0  # importing a reward file may load a judge model or a large library
_MAX_START_FAILURES = 3  # consecutive workers dying before "ready": the reward file itself is broken


class WorkerStartError(RuntimeError):
    """Reward workers cannot start (the reward file fails to import in a worker, or workers keep dying)."""


@dataclass
class PoolTask:
    """One call to run in a worker."""

    task_id: int
    mode: str
    """``batch`` or ``each`` (see :mod:`easyrl.rewards._worker`)."""
    inputs: list[Any]
    time_limit_s: float
    """Seconds from dispatch until the worker is killed and the task reported as timed out."""


@dataclass
class TaskFailure:
    """The task produced no payload: ``kind`` is ``timeout`` or ``crash``."""

    kind: str
    message: str


@dataclass
class _Slot:
    process: Any = None
    conn: Any = None
    ready: bool = False
    started_at: float = 0.0
    task: PoolTask | None = None
    deadline: float = 0.0
    replaced: int = field(default=0)


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
        worker_args: arguments of :func:`easyrl.rewards._worker.worker_main` after the connection.
    """

    def __init__(self, num_workers: int, worker_args: tuple[Any, ...]) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._ctx = _context()
        self._worker_args = worker_args
        self._slots = [_Slot() for _ in range(num_workers)]
        self._start_failures = 0
        self._closed = False
        for slot in self._slots:
            self._start(slot)

    # ------------------------------------------------------------------ process management

    def _start(self, slot: _Slot) -> None:
        from easyrl.rewards._worker import worker_main

        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child_conn, *self._worker_args), daemon=True, name="easyrl-reward-worker"
        )
        process.start()
        child_conn.close()  # the parent keeps only its end, so EOF is seen when the worker dies
        slot.process, slot.conn, slot.ready, slot.task = process, parent_conn, False, None
        slot.started_at = time.monotonic()

    def _kill(self, slot: _Slot) -> None:
        if slot.process is not None and slot.process.is_alive():
            slot.process.kill()
        if slot.process is not None:
            slot.process.join(timeout=5)
        if slot.conn is not None:
            slot.conn.close()
        slot.process = slot.conn = None

    def _replace(self, slot: _Slot) -> None:
        self._kill(slot)
        slot.replaced += 1
        self._start(slot)

    @property
    def num_replaced(self) -> int:
        """Workers replaced so far (killed for a timeout, or died)."""
        return sum(slot.replaced for slot in self._slots)

    # ------------------------------------------------------------------ running

    def run(self, tasks: list[PoolTask]) -> dict[int, Any]:
        """Run ``tasks`` on the pool; return ``task_id -> payload`` (or a :class:`TaskFailure`)."""
        if self._closed:
            raise RuntimeError("the reward worker pool is closed")
        pending = deque(tasks)
        results: dict[int, Any] = {}
        while pending or any(slot.task is not None for slot in self._slots):
            for slot in self._slots:
                if pending and slot.ready and slot.task is None:
                    self._dispatch(slot, pending)
            self._wait_and_collect(results)
            self._enforce_deadlines(results)
        return results

    def _dispatch(self, slot: _Slot, pending: deque[PoolTask]) -> None:
        task = pending.popleft()
        try:
            slot.conn.send(("task", task.task_id, task.mode, task.inputs))
        except (BrokenPipeError, EOFError, OSError):
            # The worker died while idle; the task never started, so it goes back to the queue.
            pending.appendleft(task)
            self._on_death(slot, {})
            return
        slot.task = task
        slot.deadline = time.monotonic() + task.time_limit_s

    def _wait_and_collect(self, results: dict[int, Any]) -> None:
        now = time.monotonic()
        deadlines = [slot.deadline for slot in self._slots if slot.task is not None]
        deadlines += [slot.started_at + _STARTUP_TIMEOUT_S for slot in self._slots if not slot.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        handles: dict[Any, _Slot] = {}
        for slot in self._slots:
            handles[slot.conn] = slot
            handles[slot.process.sentinel] = slot
        for handle in connection.wait(list(handles), timeout=timeout):
            slot = handles[handle]
            if handle is not slot.conn and handle is not getattr(slot.process, "sentinel", None):
                continue  # the slot was replaced while handling an earlier handle of this round
            self._service(slot, results)

    def _service(self, slot: _Slot, results: dict[int, Any]) -> None:
        """Read what the worker sent, or handle its death."""
        try:
            if not slot.conn.poll():
                if slot.process.is_alive():
                    return
                raise EOFError
            message = slot.conn.recv()
        except (EOFError, OSError):
            self._on_death(slot, results)
            return
        kind = message[0]
        if kind == "ready":
            slot.ready = True
            self._start_failures = 0
        elif kind == "load_error":
            self.close()
            raise WorkerStartError(f"a reward worker cannot load the reward function: {message[1]}")
        elif kind == "result" and slot.task is not None and message[1] == slot.task.task_id:
            results[slot.task.task_id] = message[2]
            slot.task = None

    def _on_death(self, slot: _Slot, results: dict[int, Any]) -> None:
        code = slot.process.exitcode if slot.process is not None else None
        if slot.task is not None:
            results[slot.task.task_id] = TaskFailure("crash", f"the reward worker process died (exit code {code})")
        elif not slot.ready:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self.close()
                raise WorkerStartError(
                    f"reward workers keep dying before they are ready (last exit code {code}); "
                    "check that the reward file imports cleanly in a fresh process"
                )
        logger.warning("a reward worker process died (exit code %s); starting a replacement", code)
        self._replace(slot)

    def _enforce_deadlines(self, results: dict[int, Any]) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.task is not None and now >= slot.deadline:
                task = slot.task
                results[task.task_id] = TaskFailure("timeout", f"no result after {task.time_limit_s:g} s")
                # A sync call cannot be interrupted from outside; the only way to free the slot is a new process.
                self._replace(slot)
            elif not slot.ready and now >= slot.started_at + _STARTUP_TIMEOUT_S:
                self.close()
                raise WorkerStartError(f"a reward worker did not become ready within {_STARTUP_TIMEOUT_S:g} s")

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop all workers (politely, then by force)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot.conn is not None and slot.task is None:
                with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                    slot.conn.send(("stop",))
        deadline = time.monotonic() + 2.0
        for slot in self._slots:
            if slot.process is not None:
                slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(slot)
