"""Cleaning up after a driver that died without shutting its private Ray instance down.

A driver killed with SIGKILL (or ended by `os._exit`, or by the OOM killer) runs no exit hook: the Ray processes
it started (GCS, raylet, agents, workers) stay behind holding loopback ports, and its session folder stays on disk,
with no line saying why. `start_reaper` starts a small watcher in its own session (so a signal to the driver's
process group does not reach it) that polls the driver; when the driver is gone it says so in one line on the
driver's stderr, stops every process of this user whose command line names the run's session folder, and removes
the folder. A clean exit stops the watcher first (`stop_reaper`), so it never acts on a run that ended well.

Run as `python -m easyrl.distributed.reaper <driver pid> <driver start time> <session folder>`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time


__all__ = ["start_reaper", "stop_reaper"]

_POLL_S = 0.5
_GRACE_S = 3.0  # SIGTERM first (Ray's processes flush logs and release ports), then SIGKILL


def start_reaper(session: str) -> subprocess.Popen[bytes]:
    """Start the watcher for this process and its Ray session folder `session`."""
    import psutil

    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, "-m", "easyrl.distributed.reaper", str(me.pid), repr(me.create_time()), session],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # outside the driver's process group: Ctrl-C or a group kill leaves it running
        close_fds=True,
    )


def stop_reaper(proc: subprocess.Popen[bytes]) -> None:
    """The driver is shutting down cleanly: the watcher has nothing to do."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def _session_processes(session: str) -> list[object]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                continue
            if any(session in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.Error, TypeError):
            continue
    return found


def _reap(driver_pid: int, session: str) -> None:
    import psutil

    print(
        f"easyrl: the driver (pid {driver_pid}) ended without shutting down (killed?); stopping the Ray processes "
        f"it started and removing {session}",
        file=sys.stderr,
        flush=True,
    )
    procs = _session_processes(session)
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # already gone
            proc.terminate()  # type: ignore[attr-defined]
    _, alive = psutil.wait_procs(procs, timeout=_GRACE_S)  # type: ignore[arg-type]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    latest = os.path.join(os.path.dirname(session), "session_latest")
    if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(session):
        os.unlink(latest)
    shutil.rmtree(session, ignore_errors=True)


def main(argv: list[str]) -> int:
    import psutil

    driver_pid, started, session = int(argv[0]), float(argv[1]), argv[2]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the driver's clean exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            # Same pid and start time: still our driver (a pid reused by another process does not count).
            driver = psutil.Process(driver_pid)
            alive = driver.create_time() == started and driver.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            _reap(driver_pid, session)
            return 0
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
