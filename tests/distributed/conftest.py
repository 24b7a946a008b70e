"""One private Ray instance, started in a fresh process and left to exit, whose traces several tests read: what
listens (tests/distributed/test_dist_ports.py), what runs and its session folder after exit (test_ray_session.py).
Each start costs a Python, torch's import and Ray's start (~10 s of wall time on 2 cores), so it is started once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO


LIST_LISTENERS = """
import json, psutil
def listeners(procs):
    out = []
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append([proc.name(), conn.laddr.ip, conn.laddr.port])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out
me = psutil.Process()
"""
"""Probe code's prefix: `listeners(procs)`, the (name, ip, port) each process listens on; `me`, this process."""

_PROBE = (
    LIST_LISTENERS
    + """
import sys, time, ray
from easyrl.distributed import init_ray
from ray._raylet import AuthenticationMode, get_authentication_mode

init_ray(num_cpus=2, _temp_dir=sys.argv[1])
time.sleep(2)  # pre-started workers, were there any, would be up by now
tree = [" ".join(proc.cmdline()) for proc in me.children(recursive=True)]  # before any actor starts a worker

@ray.remote
class Echo:
    def ping(self):
        return 1

actor = Echo.remote()
assert ray.get(actor.ping.remote()) == 1
time.sleep(1.0)  # the agents open their ports shortly after start
print(json.dumps({
    "session": ray._private.worker._global_node.get_session_dir_path(),
    "tree": tree,
    "token_auth": get_authentication_mode() == AuthenticationMode.TOKEN,
    "listeners": listeners([me, *me.children(recursive=True)]),
}))
"""
)  # then the process exits: the session folder's removal is init_ray's exit hook at work


@dataclass(frozen=True)
class PrivateRayRun:
    """What a process that started a private Ray instance saw, and the temp root it gave Ray."""

    report: dict[str, Any]
    stderr: str
    root: Path
    other_session: Path  # another run's session folder, made before the start: must survive the exit


@pytest.fixture(scope="session")
def private_ray_run() -> Iterator[PrivateRayRun]:
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths live under it
    other = root / "session_2020-01-01_00-00-00_000000_1"
    (other / "logs").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(root)], capture_output=True, text=True,
                              timeout=240, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield PrivateRayRun(json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, root, other)
    finally:
        shutil.rmtree(root, ignore_errors=True)
