"""User code of a multi-turn run (tools and environment methods) run on the driver with a deadline and a guard.

Environments and tools are the user's objects and live in the driver (an environment keeps its state between calls),
so each call runs on a daemon thread of its own, which the driver waits for until the call's deadline. Three things a
call could do to the run are refused or bounded here:

- ending the process: `os._exit` from a guarded thread raises instead (the reward room's guard, shared:
  `easyrl.rewards._worker`), and `SystemExit` is caught; either is that call's error, naming it;
- forking: `os.fork` / `os.forkpty` from a guarded thread are refused by an audit hook (a fork of a threaded driver
  leaves a copy that deadlocks on a lock some other thread held); `subprocess` (fork and exec at once) stays allowed;
- hanging: past its deadline the call is answered as timed out. Python cannot stop a thread, so the thread is left
  running; `CallGuard` counts, per owner (a tool, an environment), the calls still running past their deadline, and
  once `max_hung` of one owner are, its next calls are refused at once: a hung owner costs at most `max_hung`
  deadlines and threads, never one per call.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from easyrl.rewards._worker import GUARDED_THREADS, ProcessExitError, guarded_exit


__all__ = ["CallGuard", "ForkRefused", "Outcome", "clean_text"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_FORK_EVENTS = frozenset({"os.fork", "os.forkpty"})
_hook_lock = threading.Lock()
_hook_installed = False


class ForkRefused(RuntimeError):
    """A tool or environment method tried to fork the driver."""


def _refuse_fork(event: str, args: tuple[Any, ...]) -> None:
    # An audit hook runs for every audited event of the process: keep it to one set lookup for the others.
    if event in _FORK_EVENTS and threading.get_ident() in GUARDED_THREADS:
        raise ForkRefused(
            "called os.fork, which would copy the training process with its locks held; refused (run a program "
            "with subprocess instead)"
        )


def _install_guards() -> None:
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        sys.addaudithook(_refuse_fork)  # audit hooks cannot be removed: installed once per process
        os._exit = guarded_exit  # type: ignore[assignment]  # other threads still exit through the real one
        _hook_installed = True


@dataclass(frozen=True)
class Outcome:
    """What one guarded call gave: its value (`error` None), or why it gave none."""

    value: Any = None
    error: str | None = None
    """`Type: message`, or what the guard refused; None when the call returned."""
    timed_out: bool = False
    refused: bool = False
    """The guard answered without calling: the owner's hung calls are at `max_hung`."""
    fatal: bool = False
    """The call tried to end or fork the process, or timed out: a failure of the owner, not of the model's input."""


class CallGuard:
    """Runs calls on guarded daemon threads with a deadline; counts each owner's calls still hung."""

    def __init__(self, max_hung: int) -> None:
        self.max_hung = max(1, max_hung)
        self._lock = threading.Lock()
        self._hung: Counter[str] = Counter()
        _install_guards()

    def hung(self, owner: str) -> int:
        """The calls of `owner` still running past their deadline."""
        with self._lock:
            return self._hung[owner]

    def call(self, owner: str, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> Outcome:
        """`fn(**kwargs)` within `timeout_s` (a caller that turns the value into text does it inside `fn`: a slow
        `__str__` is the call's time too)."""
        with self._lock:
            if self._hung[owner] >= self.max_hung:
                return Outcome(
                    error=f"{self._hung[owner]} earlier call(s) of {owner} are still running past their deadline; "
                    "not called again until they end",
                    refused=True,
                    fatal=True,
                )
        box: dict[str, Any] = {}
        finished = threading.Event()
        late = threading.Event()

        def target() -> None:
            GUARDED_THREADS.add(threading.get_ident())
            try:
                box["value"] = fn(**kwargs)
            except ProcessExitError:
                box["error"], box["fatal"] = "tried to end the training process (os._exit); refused", True
            except ForkRefused as exc:
                box["error"], box["fatal"] = str(exc), True
            except BaseException as exc:  # SystemExit too: a tool never ends the run
                box["error"] = f"{type(exc).__name__}: {_text_of(exc)}"
            finally:
                GUARDED_THREADS.discard(threading.get_ident())
                with self._lock:
                    finished.set()
                    if late.is_set():  # it was counted hung: it no longer is
                        self._hung[owner] -= 1

        threading.Thread(target=target, daemon=True, name=f"easyrl-guarded-{owner}"[:60]).start()
        finished.wait(timeout_s)
        with self._lock:
            if not finished.is_set():
                late.set()
                self._hung[owner] += 1
                return Outcome(error=f"did not finish within {timeout_s:g}s", timed_out=True, fatal=True)
        if "error" in box:
            return Outcome(error=box["error"], fatal=box.get("fatal", False))
        return Outcome(value=box.get("value"))


def _text_of(exc: BaseException) -> str:
    """An exception's message, whatever its `__str__` does (raises, or holds a lone surrogate)."""
    try:
        return clean_text(str(exc))
    except Exception:
        return "(its message cannot be shown)"


def clean_text(text: str) -> str:
    """`text` with lone surrogates replaced (U+FFFD): a tokenizer cannot encode them, and the trajectory must go on."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
