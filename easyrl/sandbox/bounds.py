"""Bounds on a whole sandboxed program, not on each of its processes or files.

``RLIMIT_AS`` and ``RLIMIT_FSIZE`` bound one process and one file: a program that forks held 3.7 GB under a 1 GB
limit, and one writing many files put 1.15 GB on disk in 4 s. Two bounds here cover the whole program:

- memory: the anonymous resident memory (RSS less file-backed and shared pages, so pages a fork shares with its
  parent are not counted twice by the kernel's own split) of every process in the sandbox's tree, summed and polled
  every :data:`POLL_S`; the program is killed once the sum passes ``memory_mb``. A cgroup would be exact but is not
  writable in most containers (nor here); between two polls the sum can pass the limit by what the program
  allocates in that time, and each process stays under ``RLIMIT_AS`` all along;
- disk: in ``bwrap`` and ``unshare`` the scratch dir is a tmpfs of ``max_disk_mb`` (the kernel answers ENOSPC past
  it); in ``rlimits`` the scratch dir's total size is polled as above and the program killed past it.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil


__all__ = ["POLL_S", "program_memory_mb", "tree_size_mb"]

POLL_S = 0.05


def program_memory_mb(pid: int) -> float:
    """Anonymous resident MiB of ``pid`` and all its descendants (0 for a process already gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for process in processes:
        try:
            info = process.memory_info()
        except psutil.Error:
            continue  # exited between the listing and the read
        total += max(0, info.rss - getattr(info, "shared", 0))
    return total / (1 << 20)


def tree_size_mb(path: Path) -> float:
    """MiB allocated on disk by the files under ``path`` (blocks, not apparent sizes: sparse files count as written)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue
    return total / (1 << 20)
