"""A private Ray instance starts lean and removes its own session folder at exit, and only its own (the instance is
tests/distributed/conftest.py's `private_ray_run`, shared with test_dist_ports.py)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.conftest import PrivateRayRun


def test_own_session_folder_removed_at_exit(private_ray_run: PrivateRayRun) -> None:
    root, other = private_ray_run.root, private_ray_run.other_session
    session = Path(private_ray_run.report["session"])
    assert session.parent == root and session.name.startswith("session_")
    assert not session.exists(), f"{session} was left behind"
    assert not (root / "session_latest").exists()
    assert (other / "logs").is_dir()


def test_private_instance_starts_lean(private_ray_run: PrivateRayRun) -> None:
    """A local run's Ray has no dashboard/API server, no autoscaler monitor and no idle pre-started workers
    (issue 29); what remains is GCS, raylet, the raylet's two agents, the log monitor and easyrl's reaper."""
    tree = "\n".join(private_ray_run.report["tree"])
    assert "gcs_server" in tree and "raylet" in tree, tree  # the instance did start
    for absent in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "ray::IDLE"):
        assert absent not in tree, f"{absent} runs in a local instance:\n{tree}"
    # Token auth on (Ray's default for a new local cluster), without Ray's warning about it on every run.
    assert private_ray_run.report["token_auth"]
    assert "Token authentication" not in private_ray_run.stderr, private_ray_run.stderr
