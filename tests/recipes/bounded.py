"""Stopping a bounded run so that it says where it was: its stacks first, then an interrupt, then its whole group.

Each run is started in a session of its own (`start_new_session=True`), so Ray's processes that it started are in
its process group and go with it: the next run starts on a clean machine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess


STOP_GRACE_S = 10.0
"""How long an interrupted run may unwind (pytest prints its summary, a trainer closes) before its group is killed."""


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGUSR1 (the process dumps every thread's stack into its log: `faulthandler.register`), SIGINT (the code in
    progress raises KeyboardInterrupt and unwinds), then SIGKILL to the process group."""
    for sig, wait_s in ((signal.SIGUSR1, 1.0), (signal.SIGINT, STOP_GRACE_S)):
        if proc.poll() is None:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def stuck_at(log_tail: str) -> str:
    """Where the main thread was when the stacks were dumped ('' when the log holds no dump): the innermost frame of
    faulthandler's "Current thread" block, as `file:line in function`."""
    lines = log_tail.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread")]
    if not starts:
        return ""
    for line in lines[starts[-1] + 1 :]:
        match = _FRAME.match(line)
        if match:
            return f"{os.path.relpath(match.group(1))}:{match.group(2)} in {match.group(3)}"
    return ""
