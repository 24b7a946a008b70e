"""SIGTERM / SIGINT / SIGHUP handling of the `easyrl` command, the same from its first line to its last.

A hang-up (SIGHUP: the SSH session or terminal closed) is a stop request like SIGTERM, exit code 129, unless the
command was started with it ignored (``nohup``), which stays so.

* From the start of `easyrl.cli.main` until a trainer exists, a signal stops at once: the handler raises
  :class:`StartupInterrupted`, the partly built trainer releases what it started, and the command exits with
  ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) and one line on stderr, never a traceback.
* Once the trainer runs, :func:`install_stop_handlers` takes over: the first signal stops at the next stage
  boundary (saving if asked; exit code again 143 / 130), a second one stops at once. A worker call the driver is
  waiting on gets `trainer.stop_grace_s` to end; past that the wait gives up (`easyrl.distributed.liveness`) and the
  run stops without saving, since the workers are still inside the call.

``ray.init`` installs its own SIGTERM handler (it exits with 15, or 1 after killing Ray's processes);
:func:`keep_handlers` puts ours back around it, and turns an exit raised by Ray's handler during the call into
:class:`StartupInterrupted`. Ray's processes started in that block ignore SIGHUP: a closing terminal signals its
whole process group, and they must outlive the driver's stop (its checkpoint is saved through them) and then end
with it (the driver shuts Ray down on its way out).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn


__all__ = [
    "StartupInterrupted",
    "clear_stop_request",
    "exit_code",
    "exit_promptly",
    "install_early_handlers",
    "install_stop_handlers",
    "keep_handlers",
    "startup_interruption",
    "stop_requested",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_handled: tuple[int, ...] = STOP_SIGNALS  # the stop signals this process handles (SIGHUP left out under nohup)


class StartupInterrupted(BaseException):
    """A stop signal arrived before training started. A BaseException so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} during start-up")
        self.signum = signum


def startup_interruption(exc: BaseException) -> StartupInterrupted | None:
    """The :class:`StartupInterrupted` that `exc` carries in its chain (`__cause__` / `__context__`), if any. A signal
    handler that raises while a C extension runs (Ray's `CoreWorker.wait`, waiting on the workers' start) may surface
    as that extension's `SystemError: ... returned a result with an exception set`, the handler's exception its
    cause: it is still the stop the signal asked for."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, StartupInterrupted):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by `signum`: 128 + signum."""
    return 128 + int(signum)


def _raise_startup_interrupted(signum: int, frame: object) -> None:
    del frame
    raise StartupInterrupted(signum)


def install_early_handlers() -> None:
    """Make SIGTERM / SIGINT / SIGHUP raise :class:`StartupInterrupted` (call first thing in the command)."""
    global _handled
    if threading.current_thread() is threading.main_thread():
        # Started under nohup (SIGHUP ignored): the user asked to outlive the terminal, so hang-ups stay ignored.
        hup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        _handled = tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and hup_ignored))
        for signum in _handled:
            signal.signal(signum, _raise_startup_interrupted)


_stop: tuple[float, str, float] | None = None  # (time.monotonic() of the request, signal name, wait grace in s)


def stop_requested() -> tuple[float, str, float] | None:
    """(when, by which signal, the grace a worker call already running gets) of the run's stop request, if any:
    `easyrl.distributed.liveness` stops waiting on a call started before it once the grace has passed, so a stop
    is honoured even while the driver waits on a call that never ends."""
    return _stop


def clear_stop_request() -> None:
    """Forget the stop request (a new run in the same process, as tests make)."""
    global _stop
    _stop = None


def install_stop_handlers(
    request_stop: Callable[[str], None], already_stopping: Callable[[], bool], wait_grace_s: float = 30.0
) -> None:
    """First SIGTERM/SIGINT/SIGHUP: `request_stop(name)` (stop at the next stage boundary; a worker call in flight
    gets `wait_grace_s` to end, see :func:`stop_requested`); a second: stop now."""
    clear_stop_request()

    def handle(signum: int, frame: object) -> None:
        global _stop
        del frame
        if already_stopping():
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        _stop = (time.monotonic(), name, wait_grace_s)
        request_stop(name)

    for signum in _handled:
        signal.signal(signum, handle)


@contextlib.contextmanager
def keep_handlers() -> Iterator[None]:
    """When this module's handlers are installed, restore them after the block (``ray.init`` replaces SIGTERM's);
    an exit that Ray's handler raises inside the block becomes :class:`StartupInterrupted`."""
    saved: dict[int, Any] = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}  # SIGHUP's as well
    ours = getattr(saved[signal.SIGTERM], "__module__", None) == __name__
    if not ours or threading.current_thread() is not threading.main_thread():
        yield  # a library user's process: Ray's handling stays as Ray sets it
        return
    # Ignored dispositions survive fork and exec: the services ray.init starts (and the workers they start) inherit
    # this one, so a hang-up of the terminal's process group leaves them running for the driver's orderly stop.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    except SystemExit as exc:
        # ray.init exits only from its SIGTERM handler (sys.exit(15), or sys.exit(1) after its clean-up).
        raise StartupInterrupted(signal.SIGTERM) from exc
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def exit_promptly(code: int) -> NoReturn:
    """End the process with `code` now that the command is done, skipping only Python's module teardown.

    After a run, that teardown (torch, Ray's core worker and its gRPC threads, module by module) took ~3 s on the
    CPU demo with nothing left to do (docs/benchmarks.md, issue 29). Everything a normal exit does for the run
    happens first, in the same order: other non-daemon threads are joined, then the exit hooks run (Ray's
    shutdown, the session folder's removal, the loggers' flush), then the standard streams are flushed.
    """
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not replace the exit code
            stream.flush()
    os._exit(code)
