"""Two Ray nodes on this machine, one worker on each: two GRPO steps equal the one-node run with two workers.

The cluster is started with the commands docs/distributed.md gives (`ray start --head`, then `ray start
--address=...` for the second node), each node with one CPU, so the placement group of two one-CPU bundles must
put one worker on each node. The nodes get their own ports, temp folder and auth token, so other Ray instances on
the machine are neither joined nor stopped: the teardown kills this cluster's process groups (and anything left
that names its temp folder), never a bare `ray stop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, base_config, train_steps, write_config


pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
# Metrics that depend on wall time, memory or the machine, not on the computation.
_VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")


class LocalCluster:
    """A head node and a second node, one CPU each, on this machine's address; `stop()` ends only them."""

    def __init__(self) -> None:

        from easyrl.distributed.worker_group import pick_free_port

        # A short folder: Ray's unix sockets live under it and their paths are limited to 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ray2n", dir="/tmp")
        # Asked of a fresh process: an earlier test's private instance sets Ray's local-only flag in this one,
        # and then Ray answers 127.0.0.1 here.
        clean = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        probe = "import ray; print(ray.util.get_node_ip_address())"
        self.ip = subprocess.run(
            [sys.executable, "-c", probe], env=clean, capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
        ports = [pick_free_port() for _ in range(11)]
        self.address = f"{self.ip}:{ports[0]}"
        token = Path(self.temp_dir) / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        # Ray >= 2.52 turns token authentication on when ~/.ray/auth_token exists; every process of this cluster
        # (nodes, driver, workers) reads this cluster's own token instead.
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "PYTHONPATH": str(REPO),
        }
        for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(key, None)
        common = ["--node-ip-address", self.ip, "--num-cpus=1", "--num-gpus=0", "--temp-dir", self.temp_dir]
        common += ["--object-store-memory=100000000", "--disable-usage-stats"]
        self.head = [*common, "--head", f"--port={ports[0]}", "--include-dashboard=false"]
        self.head += [f"--ray-client-server-port={ports[1]}"]
        self.node = [*common, f"--address={self.address}"]
        for cmd, first in ((self.head, 3), (self.node, 7)):  # agents: fixed default ports would collide
            cmd += [
                f"--dashboard-agent-listen-port={ports[first]}",
                f"--dashboard-agent-grpc-port={ports[first + 1]}",
                f"--runtime-env-agent-port={ports[first + 2]}",
                f"--metrics-export-port={ports[first + 3]}",
            ]
        self.process_groups: list[int] = []

    def start(self) -> None:
        for args in (self.head, self.node):
            # A new session per node: the daemons `ray start` leaves behind keep its process group (its pid).
            proc = subprocess.Popen(
                [RAY, "start", *args],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.process_groups.append(proc.pid)
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"ray start {' '.join(args)} failed:\n{out[-3000:]}"

    def stop(self) -> None:
        """SIGTERM then SIGKILL this cluster's process groups and any process naming its temp folder."""
        import psutil

        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in self.process_groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, sig)
            for proc in psutil.process_iter(["cmdline"]):
                if self.temp_dir in " ".join(proc.info["cmdline"] or []):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.send_signal(sig)
            time.sleep(2.0 if sig == signal.SIGTERM else 0.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    local = LocalCluster()
    try:
        local.start()
        yield local
    finally:
        local.stop()


def _train(cfg: str, env: dict[str, str], *overrides: str) -> str:
    """`easyrl train cfg overrides...` in a subprocess; returns its log (stderr)."""
    cmd = [sys.executable, "-m", "easyrl.cli", "train", cfg, *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return proc.stderr


def _rows(run: Path) -> list[dict[str, float]]:
    lines = (run / "experiment_log.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(_VOLATILE)} for line in lines]


def _actor_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = run / "global_step_2" / "actor"
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update({f"{shard.name}/{k}": v for k, v in load_file(shard).items()})
    assert out, f"no safetensors shards in {folder}"
    return out


def _config(tmp_path: Path, model: str, data: dict[str, str], name: str) -> str:
    conf = base_config(model, data, tmp_path / name)
    conf["trainer"].update({"max_steps": 2, "save_freq": 2})
    return write_config(tmp_path / f"{name}.yaml", conf)


def test_two_nodes_match_one_node(tmp_path: Path, tiny_model_dir, digits_data, cluster: LocalCluster) -> None:
    # The one-node run in this process (a private instance, the trainer `easyrl train` runs; a command of its own
    # would add a Python start and a Ray start to compare against the same numbers).
    train_steps(tmp_path / "one", tiny_model_dir, digits_data, {"trainer.save_freq": 2}, steps=2)

    two = _config(tmp_path, tiny_model_dir, digits_data, "two_nodes")
    log = _train(two, {**cluster.env, "RAY_ADDRESS": cluster.address}, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
    assert "2 bundles {'CPU': 1.0} (PACK) on 2 node(s)" in log, log[-3000:]
    assert f"rendezvous {cluster.ip}:" in log, log[-3000:]  # rank 0's node address, the one the other node reaches

    rows_one, rows_two = _rows(tmp_path / "one" / "run"), _rows(tmp_path / "two_nodes")
    assert [r["step"] for r in rows_two] == [1, 2]
    assert rows_one[0].keys() == rows_two[0].keys()
    # Same data-parallel size, seeds and thread counts: the same rollouts and the same sums in the same order, so
    # the two runs are bit-identical (only the transport between the two ranks differs).
    for a, b in zip(rows_one, rows_two, strict=True):
        assert b == a, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    weights_one, weights_two = _actor_weights(tmp_path / "one" / "run"), _actor_weights(tmp_path / "two_nodes")
    assert weights_one.keys() == weights_two.keys()
    unequal = [name for name, value in weights_one.items() if not torch.equal(weights_two[name], value)]
    assert not unequal, unequal
