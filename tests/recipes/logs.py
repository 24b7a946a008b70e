"""The ends of the logs a failure report carries: the driver's own, and the Ray workers' of its session."""

from __future__ import annotations

import os
import re
from pathlib import Path


LOG_TAIL_LINES = 60
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a text file, without colour codes ('' when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 400 * lines))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(_ANSI.sub("", text).splitlines()[-lines:])


def worker_log_tails(limit: int = 3) -> str:
    """The ends of the Ray worker logs written most recently in this process's Ray session ('' without one)."""
    try:
        import ray

        node = ray._private.worker._global_node  # the session this process started or joined
        logs = Path(node.get_session_dir_path()) / "logs" if node is not None else None
    except Exception:  # Ray not imported or not initialized: nothing to read
        return ""
    if logs is None or not logs.is_dir():
        return ""
    files = [f for f in logs.glob("worker-*") if f.suffix in (".out", ".err") and f.stat().st_size]
    newest = sorted(files, key=lambda f: f.stat().st_mtime)[-limit:]
    return "\n".join(f"--- {f.name}\n{tail(f, 30)}" for f in newest)
