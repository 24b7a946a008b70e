"""``torch.distributed`` set-up inside a worker process started by a :class:`~easyrl.distributed.WorkerGroup`.

The group gives every worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``EASYRL_ROLE``; :func:`init_distributed` reads them. With a loopback ``MASTER_ADDR`` (a single-node run) rank 0's
rendezvous store listens on loopback only: ``torch.distributed`` would otherwise bind it to every interface.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any


__all__ = ["DistInfo", "dist_info", "init_distributed"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """The distributed identity of the current worker, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    role: str


def dist_info() -> DistInfo:
    """Rank, world size, local rank and role of this worker (rank 0 of 1 outside a worker group)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        role=os.environ.get("EASYRL_ROLE", ""),
    )


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> Any:
    """The rendezvous store of a single-node group; rank 0 hosts it on a socket bound to 127.0.0.1 (TCPStore
    itself would listen on every interface)."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(max(128, world_size))
    return TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store takes the socket over
    )


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Initialize the default ``torch.distributed`` process group of this worker (idempotent).

    Args:
        backend: ``"nccl"`` or ``"gloo"``; by default nccl when CUDA is available, else gloo.
        timeout_s: the process-group timeout (rendezvous and collectives).

    On CUDA, the current device is set to the process's own GPU (`easyrl.distributed.device`: device 0 of a Ray
    worker, which sees only its own; ``LOCAL_RANK`` under torchrun).
    """
    import torch
    import torch.distributed as dist

    from easyrl.distributed.device import use_process_device

    info = dist_info()
    if dist.is_available() and dist.is_initialized():
        return info
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        use_process_device()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    logger.debug(
        "init_distributed role=%s rank=%d/%d backend=%s at %s:%s",
        info.role,
        info.rank,
        info.world_size,
        backend,
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    if is_loopback(os.environ["MASTER_ADDR"]):
        store = loopback_store(info.rank, info.world_size, int(os.environ["MASTER_PORT"]), timeout)
        dist.init_process_group(
            backend=backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    else:  # several nodes: the user's network setup decides what is exposed
        dist.init_process_group(
            backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    return info
