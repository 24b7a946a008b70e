"""A private Ray instance keeps its temp folders under a per-user 0700 folder, and a driver killed with SIGKILL
leaves no Ray process and no session folder behind, with one line saying so; a stale RAY_ADDRESS is one line
(issue 36)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from easyrl.distributed.errors import ClusterUnreachableError
from tests.conftest import REPO


def _session_processes(session: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(session in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_private_temp_folder_and_cleanup_after_sigkill() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # TMPDIR, short: Ray's socket paths live under it
    os.chmod(tmp, 0o755)
    code = """
import os, signal, sys, ray
from easyrl.distributed import init_ray
init_ray(num_cpus=1)
print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit hook runs
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": str(tmp)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_TMPDIR", None)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        # Returns when every holder of the pipes is gone: the driver, Ray's processes and the reaper after them.
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == -signal.SIGKILL, out
        session = out.strip().splitlines()[-1]
        root = tmp / f"easyrl-ray-{os.getuid()}"
        assert Path(session).parent == root / "ray"
        assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.getuid()
        deadline = time.monotonic() + 60
        while (os.path.exists(session) or _session_processes(session)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not os.path.exists(session), f"{session} was left behind"
        assert _session_processes(session) == [], "Ray processes outlived the killed driver"
        assert f"the driver (pid {proc.pid}) ended without shutting down" in err, err[-2000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_unreachable_ray_address_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from easyrl.distributed import init_ray

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(
        ClusterUnreachableError, match=rf"RAY_ADDRESS: 127\.0\.0\.1:{port}: nothing answers .* unset RAY_ADDRESS"
    ):
        init_ray(num_cpus=1)
