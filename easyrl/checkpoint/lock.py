"""One run per run folder: an exclusive lock held by the driver from start-up to exit.

Two runs on one folder would overwrite each other's checkpoints, prune each other's folders and log every step
twice. The lock is an `flock` on `<run folder>/.easyrl_run.lock`: the kernel releases it when its holder dies,
however it dies (`kill -9` included), so a killed run never leaves a lock behind. The file records the holder's pid,
host and process start time, which the refusal message names. As a second guard for filesystems where `flock` is
not enforced, a lock file naming a live process on this host (same pid and start time) is refused too; one naming a
process that is gone is stale and taken over, with a log line saying so.

The file is never deleted (deleting a lock file races with the next run opening it); releasing empties it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import stat
from typing import IO, Any

from easyrl.checkpoint.errors import CheckpointError


logger = logging.getLogger(__name__)

LOCK_FILE = ".easyrl_run.lock"


class RunLockedError(CheckpointError):
    """Another live run holds the run folder."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name, which may hold spaces


def _holder_alive(holder: dict[str, Any]) -> bool:
    """Whether the recorded holder is a live process on this host (the pid not reused by another process)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    return holder["pid"] != os.getpid() and _start_time(holder["pid"]) == holder.get("start_time")


class RunLock:
    """The exclusive lock on one run folder; `release` (or process exit) frees it."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise `RunLockedError` naming the folder and the holder's pid and host."""
        os.makedirs(self.run_dir, exist_ok=True)
        # O_NONBLOCK: a FIFO planted as the lock file must not block the open; checked as a regular file right after.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(
                f"{self.path} is not a regular file (a FIFO, device or socket?): remove it; easyrl makes a new one"
            )
        os.set_blocking(fd, True)
        handle = open(fd, "a+", encoding="utf-8")  # noqa: SIM115  (held open for the run's lifetime)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(handle)
            handle.close()
            raise RunLockedError(self._in_use(holder)) from None
        holder = _read(handle)
        if holder and _holder_alive(holder):  # flock not enforced here, but the recorded run is alive
            handle.close()
            raise RunLockedError(self._in_use(holder))
        if holder:
            logger.warning(
                "run folder %s: taking over the stale lock of pid %s on %s (that run is gone)",
                self.run_dir,
                holder.get("pid"),
                holder.get("host"),
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": _start_time(os.getpid())}
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(me))
        handle.flush()
        os.fsync(handle.fileno())
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.flush()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def _in_use(self, holder: dict[str, Any]) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        return (
            f"run folder {self.run_dir} is in use by another easyrl run ({who}); wait for it to end, or give this run "
            "its own trainer.save_checkpoint_path"
        )


def _read(handle: IO[str]) -> dict[str, Any]:
    handle.seek(0)
    try:
        holder = json.loads(handle.read(64 << 10) or "{}")  # a pid, a host, a time: a larger file is not ours
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}
