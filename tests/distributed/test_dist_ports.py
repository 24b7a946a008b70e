"""A single-node run listens on loopback only: Ray's processes and torch's rendezvous store."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.conftest import LIST_LISTENERS, PrivateRayRun


REPO = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: float = 240) -> Any:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", LIST_LISTENERS + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _exposed(listeners: list[list[Any]]) -> list[list[Any]]:
    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return bool((mapped or address).is_loopback)

    return [entry for entry in listeners if not loopback(entry[1])]


def test_local_ray_listens_on_loopback_only(private_ray_run: PrivateRayRun) -> None:
    """Every listening socket of the process that started Ray (with one actor up) and of all its children."""
    listeners = private_ray_run.report["listeners"]
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names, listeners  # the servers were found, so the check means something
    assert _exposed(listeners) == [], f"listening beyond loopback: {_exposed(listeners)}"


def test_rendezvous_store_listens_on_loopback_only() -> None:
    listeners = _run(
        """
        import os, torch, torch.distributed as dist
        from easyrl.distributed.worker_group import pick_free_port
        from easyrl.distributed.torch_dist import init_distributed
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pick_free_port()))
        init_distributed("gloo", timeout_s=60)
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
        found = listeners([me])
        assert any(port == int(os.environ["MASTER_PORT"]) for _, _, port in found), found
        print(json.dumps(found))
        """
    )
    assert _exposed(listeners) == [], f"listening beyond loopback: {_exposed(listeners)}"


def test_joining_a_cluster_keeps_the_users_network_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an address (a cluster started by `ray start`), nothing is forced onto loopback."""
    import ray

    from easyrl.distributed import init_ray

    seen: dict[str, Any] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(ray, "cluster_resources", dict)
    init_ray(address="10.0.0.1:6379")
    assert seen["address"] == "10.0.0.1:6379" and "_node_ip_address" not in seen
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "VLLM_HOST_IP"} & set(seen["runtime_env"]["env_vars"])


def test_rendezvous_host_is_rank_0s_node_address() -> None:
    """One node (easyrl's private instance): loopback. Several nodes: rank 0's node as the others reach it; a
    loopback rank 0 with ranks on other hosts is refused (they would wait for the store until the timeout)."""
    from easyrl.distributed import ResourceUnavailableError
    from easyrl.distributed.resource_pool import rendezvous_host

    assert rendezvous_host(["127.0.0.1", "127.0.0.1"]) == "127.0.0.1"
    assert rendezvous_host(["10.0.0.2", "10.0.0.1", "10.0.0.1"]) == "10.0.0.2"
    with pytest.raises(ResourceUnavailableError, match=r"127\.0\.0\.1, which the ranks on 10\.0\.0\.1 cannot reach"):
        rendezvous_host(["127.0.0.1", "10.0.0.1"])
