"""Code that runs reward function calls, in a worker process (or in the driver with ``num_workers=0``).

Kept free of heavy imports: every worker process imports this module before the reward file, and a replacement for
a killed worker should be ready quickly.

Every call runs off the main thread (:class:`CallRunner`): sync functions on daemon threads, one per task, async
functions on one event-loop thread. A hung call therefore never blocks the calls queued after it, and the main
thread stays free to read the pipe (in a worker) or to run a signal handler and honour a deadline (in the driver).
The parent bounds how many tasks a runner has at once (``max_concurrency``) and abandons hung calls at the batch
deadline: a worker process holding one is killed; in the driver the daemon thread is left behind.

Protocol over the worker's pipe (all tuples):

* parent -> worker: ``("task", task_id, mode, inputs)`` (several may be in flight) or ``("stop",)``;
* worker -> parent: ``("ready", pid)`` once the reward file is imported, ``("load_error", message)`` if it cannot
  be, and ``("result", task_id, payload, stats)`` per task, in completion order, where ``stats`` are the scorers'
  call counters since the last result (`easyrl.scorers.Scorers.drain`; empty without scorers).

``mode`` is ``"batch"`` (one call with the whole list; payload ``(status, value)``) or ``"each"`` (one call per
input; payload a list of ``(status, value)``). ``status`` is ``ok`` or ``error``; for ``error`` the value is a
message.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


__all__ = ["CallRunner", "Outcome", "describe_exception", "worker_main"]

Outcome = tuple[str, Any]
"""``("ok", value)`` or ``("error", message)``."""


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


class ProcessExitError(Exception):
    """An in-process reward call tried to end the process (`os._exit`, `sys.exit`): refused, reported as its error."""


# Threads now running reward code in the driver (`CallRunner(guard_exit=True)`): `os._exit` from one of them
# raises `ProcessExitError` instead of ending the training run without a word; from any other thread it exits.
GUARDED_THREADS: set[int] = set()
_REAL_EXIT = os._exit


def guarded_exit(code: int) -> NoReturn:
    if threading.get_ident() in GUARDED_THREADS:
        raise ProcessExitError(
            f"called os._exit({code}), which would end the training process; refused (return a score instead)"
        )
    _REAL_EXIT(code)


def _exit_message(exc: SystemExit) -> str:
    return f"called sys.exit({exc.code!r}) (raised SystemExit); return a score instead"


def _call_sync(fn: Callable[..., Any], arg: Any) -> Outcome:
    try:
        value = fn(arg)
        if inspect.isawaitable(value):
            # A plain def returning a coroutine (e.g. a wrapper around an async client) still gets awaited.
            value = asyncio.run(_await_maybe(value))
        return "ok", value
    except SystemExit as exc:  # on a thread it would end the thread silently and the call would time out
        return "error", _exit_message(exc)
    except Exception as exc:
        return "error", describe_exception(exc)


async def _call_async(fn: Callable[..., Any], arg: Any) -> Outcome:
    try:
        return "ok", await _await_maybe(fn(arg))
    except SystemExit as exc:
        return "error", _exit_message(exc)
    except Exception as exc:
        return "error", describe_exception(exc)


def _payload_sync(fn: Callable[..., Any], mode: str, inputs: list[Any]) -> Any:
    return _call_sync(fn, inputs) if mode == "batch" else [_call_sync(fn, item) for item in inputs]


async def _payload_async(fn: Callable[..., Any], mode: str, inputs: list[Any]) -> Any:
    if mode == "batch":
        return await _call_async(fn, inputs)
    return list(await asyncio.gather(*(_call_async(fn, item) for item in inputs)))


class CallRunner:
    """Runs tasks of one reward function off the calling thread; ``on_done(task_id, payload)`` gets each result
    from the thread that finished it (in completion order). ``guard_exit`` (the driver's in-process calls): an
    ``os._exit`` from the reward code is refused as that call's error (see `guarded_exit`)."""

    def __init__(
        self, fn: Callable[..., Any], is_async: bool, on_done: Callable[[int, Any], None], guard_exit: bool = False
    ) -> None:
        self.fn, self.is_async, self.on_done, self.guard_exit = fn, is_async, on_done, guard_exit
        if guard_exit:  # patched once per process; other threads still exit through the real os._exit
            os._exit = guarded_exit  # type: ignore[assignment]
        self._loop: asyncio.AbstractEventLoop | None = None
        if is_async:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._run_loop, daemon=True, name="easyrl-reward-loop").start()

    def _run_loop(self) -> None:
        assert self._loop is not None
        if self.guard_exit:
            GUARDED_THREADS.add(threading.get_ident())  # this thread runs nothing but reward code
        self._loop.run_forever()

    def submit(self, task_id: int, mode: str, inputs: list[Any]) -> None:
        if self._loop is not None:
            future = asyncio.run_coroutine_threadsafe(_payload_async(self.fn, mode, inputs), self._loop)
            future.add_done_callback(lambda done: self.on_done(task_id, _future_payload(done, mode, inputs)))
            return

        def run() -> None:
            if self.guard_exit:
                GUARDED_THREADS.add(threading.get_ident())
            try:
                payload = _payload_sync(self.fn, mode, inputs)
            finally:
                GUARDED_THREADS.discard(threading.get_ident())
            self.on_done(task_id, payload)

        # Daemon: a call that never returns must not keep the process alive at exit.
        threading.Thread(target=run, daemon=True, name=f"easyrl-reward-{task_id}").start()


def _future_payload(future: Any, mode: str, inputs: list[Any]) -> Any:
    try:
        return future.result()
    except BaseException as exc:  # cancelled, or a BaseException escaping the reward code
        error = ("error", describe_exception(exc))
        return error if mode == "batch" else [error] * len(inputs)


def adopt_environment(environ: dict[str, str]) -> None:
    """Make this process's environment exactly `environ`: the parent's, as it was when it started this worker."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def worker_main(conn: Any, environ: dict[str, str], reward_cfg: Any) -> None:
    """Entry point of a reward worker process: take the parent's environment (`environ`), import the reward
    (`worker.reward`, a `RewardConfig`) and build its scorers, then serve tasks until told to stop."""
    adopt_environment(environ)
    # Ctrl-C and a terminal's hang-up go to the whole process group; the parent decides when workers stop (and
    # kills hung ones), so the stop it makes (a checkpoint) is not cut short by its reward workers dying.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from easyrl.rewards.compose import load_configured_reward
    from easyrl.scorers import Scorers

    try:
        scorers = Scorers(reward_cfg)
        reward = load_configured_reward(reward_cfg, scorers)
    except Exception as exc:
        conn.send(("load_error", str(exc)))
        return
    send_lock = threading.Lock()

    def send_result(task_id: int, payload: Any) -> None:
        with send_lock:
            try:
                conn.send(("result", task_id, payload, scorers.drain()))
            except (BrokenPipeError, EOFError, OSError):
                return  # the parent is gone or killed us
            except Exception as exc:
                # Typically an unpicklable return value; pickling fails before anything is written to the pipe.
                error = ("error", f"result cannot be sent back: {describe_exception(exc)}")
                failed = error if isinstance(payload, tuple) else [error] * len(payload)
                conn.send(("result", task_id, failed, scorers.drain()))

    runner = CallRunner(reward.fn, reward.is_async, send_result)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            return
        _, task_id, mode, inputs = message
        runner.submit(task_id, mode, inputs)
