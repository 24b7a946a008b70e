"""Bounds on a whole sandboxed program, not on each of its processes or files.

``RLIMIT_AS`` and ``RLIMIT_FSIZE`` bound one process and one file: a program that forks held 3.7 GB under a 1 GB
limit, and one writing many files put 1.15 GB on disk in 4 s. Two bounds here cover the whole program:

- memory: the anonymous resident memory (RSS less file-backed and shared pages, from ``/proc/PID/statm``) of every
  process in the sandbox's tree (found through ``/proc/PID/task/TID/children``, 0.15 ms for a small tree, not a
  scan of all of /proc), summed and polled every :data:`POLL_S`; the program is killed once the sum passes ``memory_mb``. A cgroup would be exact but is not
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


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, read from each thread's ``children`` file (cheap: no scan of /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for tid in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{tid}/children") as children:
                    todo += [int(child) for child in children.read().split()]
        except OSError:
            continue  # exited meanwhile
    return found


def _anonymous_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            fields = statm.read().split()
    except OSError:
        return 0
    return max(0, int(fields[1]) - int(fields[2])) * _PAGE  # resident less file-backed and shared pages


def program_memory_mb(pid: int) -> float:
    """Anonymous resident MiB of ``pid`` and all its descendants (0 for a process already gone)."""
    if os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return sum(_anonymous_bytes(p) for p in _descendants(pid)) / (1 << 20)
    try:  # a kernel without CONFIG_PROC_CHILDREN: psutil scans /proc for the tree
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
