"""Code that runs a reward function call, in a worker process (or in-process with ``num_workers=0``).

Kept free of heavy imports: every worker process imports this module before the reward file, and a replacement for
a killed worker should be ready quickly.

Protocol over the worker's pipe (all tuples):

* parent -> worker: ``("task", task_id, mode, inputs)`` or ``("stop",)``;
* worker -> parent: ``("ready", pid)`` once the reward file is imported, ``("load_error", message)`` if it cannot
  be, and ``("result", task_id, payload)`` per task.

``mode`` is ``"batch"`` (one call with the whole list; payload ``(status, value)``) or ``"each"`` (one call per
input; payload a list of ``(status, value)``). ``status`` is ``ok``, ``error`` or ``timeout``; for the last two the
value is a message.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any


__all__ = ["Outcome", "describe_exception", "run_task", "worker_main"]

Outcome = tuple[str, Any]
"""``("ok", value)``, ``("error", message)`` or ``("timeout", message)``."""


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file.py:line in function)``: the innermost frame is where the reward code failed."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text


async def _await_maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _call_sync(fn: Callable[..., Any], arg: Any) -> Outcome:
    try:
        value = fn(arg)
        if inspect.isawaitable(value):
            # A plain def returning a coroutine (e.g. a wrapper around an async client) still gets awaited.
            value = asyncio.run(_await_maybe(value))
        return "ok", value
    except Exception as exc:
        return "error", describe_exception(exc)


async def _gather_each(
    fn: Callable[..., Any], inputs: list[Any], max_concurrency: int, timeout_s: float | None
) -> list[Outcome]:
    semaphore = asyncio.Semaphore(max(1, max_concurrency))

    async def one(item: Any) -> Outcome:
        async with semaphore:
            try:
                # The per-call timeout starts once the call holds a semaphore slot, not while it queues.
                value = await asyncio.wait_for(_await_maybe(fn(item)), timeout=timeout_s)
                return "ok", value
            except asyncio.TimeoutError:
                return "timeout", f"no result after {timeout_s:g} s"
            except Exception as exc:
                return "error", describe_exception(exc)

    return list(await asyncio.gather(*(one(item) for item in inputs)))


def run_task(
    fn: Callable[..., Any],
    is_async: bool,
    mode: str,
    inputs: list[Any],
    max_concurrency: int,
    timeout_s: float | None,
) -> Any:
    """Run one task and return its payload (see the module docstring).

    Sync calls are not timed here (only the parent can stop a stuck sync call, by killing the process); async
    calls of ``each`` tasks are, with ``timeout_s`` each, since the event loop can cancel them.
    """
    if mode == "batch":
        return _call_sync(fn, inputs)
    if is_async:
        return asyncio.run(_gather_each(fn, inputs, max_concurrency, timeout_s))
    return [_call_sync(fn, item) for item in inputs]


def worker_main(
    conn: Any,
    spec: str,
    kwargs: dict[str, Any],
    reward_type: str,
    max_concurrency: int,
    timeout_s: float,
) -> None:
    """Entry point of a reward worker process: import the reward file, then serve tasks until told to stop."""
    # Ctrl-C goes to the whole process group; the parent decides when workers stop (and kills hung ones).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from easyrl.rewards.loader import load_reward_function

    try:
        reward = load_reward_function(spec, kwargs, reward_type)
    except Exception as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            return
        _, task_id, mode, inputs = message
        payload = run_task(reward.fn, reward.is_async, mode, inputs, max_concurrency, timeout_s)
        try:
            conn.send(("result", task_id, payload))
        except Exception as exc:
            # Typically an unpicklable return value; pickling fails before anything is written to the pipe.
            error = ("error", f"result cannot be sent back: {describe_exception(exc)}")
            conn.send(("result", task_id, error if mode == "batch" else [error] * len(inputs)))
