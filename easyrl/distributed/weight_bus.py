"""A broadcast group of its own between the policy's rank 0 and rollout workers that live apart from it
(`worker.rollout.placement: separate`): the policy's full weights go from the trainer to every engine in one
broadcast per tensor, without passing through the driver (`worker.rollout.weight_transfer: broadcast`).

The group is not the workers' default process group (each role has its own, its world its ranks) but a standalone
one: its own rendezvous store on the sender's host and a backend object built on it (NCCL between GPUs, gloo on
CPU), so neither side's collectives see the other. The sender is rank 0, every receiver rank 1 + its rank in the
rollout group. The tensors' names, shapes and dtypes (the manifest) are fixed for a run: the receivers get them once
from the driver and allocate each tensor before its broadcast, so nothing but the bytes crosses.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from easyrl.distributed.torch_dist import is_loopback, loopback_store


@dataclass(frozen=True)
class BusAddress:
    """Where the sender's store listens, and the group's size (the sender and every receiver)."""

    host: str
    port: int
    world_size: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the manifest: what a receiver allocates before the broadcast fills it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's own name ("float32", "bfloat16"): plain data, it crosses Ray as a string


def manifest_of(weights: list[tuple[str, torch.Tensor]]) -> list[TensorEntry]:
    return [TensorEntry(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights]


def manifest_bytes(manifest: list[TensorEntry]) -> int:
    """What one push sends: every entry's bytes (a tied alias counts again: it is sent under each name)."""
    return sum(math.prod(e.shape) * getattr(torch, e.dtype).itemsize for e in manifest)


def sender_address(world_size: int) -> BusAddress:
    """Called in the sender's process: its own host as the group's rendezvous (the address its role's default group
    uses, so the network a multi-node run opened for that reaches this too) and a port free there."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))  # port 0: the OS picks a free one on that interface
        port = int(sock.getsockname()[1])
    return BusAddress(host, port, world_size)


class WeightBus:
    """One end of the broadcast group; `rank` 0 sends, every other rank receives."""

    def __init__(self, address: BusAddress, rank: int, device: torch.device, timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.device = device
        # The store lives in the sender; constructing it blocks until every rank has connected (the rendezvous). On
        # one node it listens on loopback only, as the roles' own stores do (TCPStore alone binds every interface).
        if is_loopback(address.host):
            self.store: Any = loopback_store(rank, address.world_size, address.port, timeout)
        else:
            self.store = dist.TCPStore(address.host, address.port, address.world_size, rank == 0, timeout=timeout)
        self.group: Any
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # the same patience as the store's; NCCL's default is 10 minutes
            self.group = dist.ProcessGroupNCCL(self.store, rank, address.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, address.world_size, timeout)

    def send(self, tensor: torch.Tensor) -> None:
        """Broadcast one tensor from the sender (rank 0) to every receiver."""
        assert self.rank == 0, "only rank 0 of a weight bus sends"
        self.group.broadcast(tensor.to(self.device).contiguous(), 0).wait()

    def receive(self, entry: TensorEntry) -> torch.Tensor:
        """The next tensor the sender broadcasts, allocated from its manifest entry."""
        tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device=self.device)
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def close(self) -> None:
        # Backend objects built by hand are not in torch's registry: dropping the references frees them.
        self.group = None
        self.store = None
