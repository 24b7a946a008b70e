"""A private Ray instance removes its own session folder at exit, and only its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO


def test_own_session_folder_removed_at_exit() -> None:
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths live under it
    other = root / "session_2020-01-01_00-00-00_000000_1"  # another run's session: must survive
    (other / "logs").mkdir(parents=True)
    code = f"""
import ray
from easyrl.distributed import init_ray
init_ray(num_cpus=1, _temp_dir={str(root)!r})
print(ray._private.worker._global_node.get_session_dir_path())
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        session = Path(proc.stdout.strip().splitlines()[-1])
        assert session.parent == root and session.name.startswith("session_")
        assert not session.exists(), f"{session} was left behind"
        assert not (root / "session_latest").exists()
        assert (other / "logs").is_dir()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_private_instance_starts_lean() -> None:
    """A local run's Ray has no dashboard/API server, no autoscaler monitor and no idle pre-started workers
    (issue 29); what remains is GCS, raylet, the raylet's two agents, the log monitor and easyrl's reaper."""
    code = """
import time, psutil, ray
from easyrl.distributed import init_ray
init_ray(num_cpus=2)
time.sleep(2)  # pre-started workers, were there any, would be up by now
for proc in psutil.Process().children(recursive=True):
    print(" ".join(proc.cmdline()))
from ray._raylet import AuthenticationMode, get_authentication_mode
print("auth:", get_authentication_mode() == AuthenticationMode.TOKEN)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tree = proc.stdout
    assert "gcs_server" in tree and "raylet" in tree, tree  # the instance did start
    for absent in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "ray::IDLE"):
        assert absent not in tree, f"{absent} runs in a local instance:\n{tree}"
    # Token auth on (Ray's default for a new local cluster), without Ray's warning about it on every run.
    assert "auth: True" in tree
    assert "Token authentication" not in proc.stderr, proc.stderr
