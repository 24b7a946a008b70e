"""The one place that decides which accelerator a process computes on.

Which CUDA index is "mine" depends on how the process was started, not on its rank alone:

* a Ray worker (an actor of a :class:`~easyrl.distributed.WorkerGroup`, ``num_gpus`` > 0): Ray sets the actor's
  ``CUDA_VISIBLE_DEVICES`` to the GPU(s) it assigned, so the process sees one device, index 0, whatever its
  ``LOCAL_RANK`` (the bundle's index on its node) is. Only with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` does
  it see every GPU of the node; its own is then the position of ``ray.get_gpu_ids()[0]`` among the visible ones;
* ``torchrun`` (or a script spawning one process per GPU): every process sees every GPU of the node and takes
  ``cuda:LOCAL_RANK``;
* no visible GPU: the CPU.

`choose_device` is that decision as a pure function of what the process sees; `process_device` feeds it the
process's own environment. Every role, engine, the NCCL set-up and every script ask `process_device`; a structure
test keeps any other code from picking a CUDA index itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch


Launcher = Literal["ray", "torchrun", "single"]

__all__ = ["Launcher", "choose_device", "detect_launcher", "process_device", "use_process_device"]


def choose_device(
    visible: Sequence[str] | None,
    local_rank: int,
    device_count: int,
    launcher: Launcher,
    ray_gpu_ids: Sequence[str] = (),
) -> torch.device:
    """The device of a process that sees `device_count` CUDA devices.

    Args:
        visible: the entries of ``CUDA_VISIBLE_DEVICES`` (None when unset: every GPU of the node is visible).
        local_rank: the process's rank on its node (``LOCAL_RANK``).
        device_count: ``torch.cuda.device_count()`` (0 without CUDA).
        launcher: who started the process (`detect_launcher`).
        ray_gpu_ids: ``ray.get_gpu_ids()`` of a Ray worker (only read when it sees several GPUs).

    Raises:
        ValueError: the process cannot tell which of several visible GPUs is its own.
    """
    if device_count <= 0:
        return torch.device("cpu")
    if device_count == 1:  # a Ray worker's own GPU, or a one-GPU machine: always index 0
        return torch.device("cuda", 0)
    if launcher == "ray":
        # Ray did not narrow CUDA_VISIBLE_DEVICES (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): the worker's GPU is
        # the one Ray assigned it, found among the visible ones (the local rank is a bundle index, not a GPU's).
        names = list(visible) if visible is not None else [str(i) for i in range(device_count)]
        own = [names.index(str(g)) for g in ray_gpu_ids if str(g) in names]
        if len(own) != 1:
            raise ValueError(
                f"a Ray worker sees {device_count} GPUs (CUDA_VISIBLE_DEVICES={','.join(names)}) and was assigned "
                f"{list(ray_gpu_ids)}: easyrl expects one GPU per worker; unset "
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES so that Ray shows each worker its own GPU"
            )
        return torch.device("cuda", own[0])
    if not 0 <= local_rank < device_count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this process sees {device_count} GPUs: start at most one process per "
            "visible GPU on a node (torchrun --nproc-per-node, or CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def detect_launcher(env: dict[str, str] | os._Environ[str] = os.environ) -> Launcher:
    """``ray`` in a WorkerGroup's actor (it sets ``EASYRL_ROLE``), ``torchrun`` under torch elastic, else ``single``
    (a script that starts its own processes, one per GPU, and sets ``LOCAL_RANK`` itself; and an inline worker,
    `easyrl.distributed.inline`, which runs in the driver's process and has no Ray GPU ids to ask)."""
    if env.get("EASYRL_BACKEND") == "inline":
        return "single"
    if env.get("EASYRL_ROLE"):
        return "ray"
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    return "single"


def process_device() -> torch.device:
    """This process's device: `choose_device` over its own environment."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v for v in visible_env.split(",") if v.strip()] if visible_env is not None else None
    launcher = detect_launcher()
    ray_ids: list[str] = []
    if launcher == "ray" and count > 1:
        import ray

        ray_ids = [str(g) for g in ray.get_gpu_ids()]
    return choose_device(visible, int(os.environ.get("LOCAL_RANK", "0")), count, launcher, ray_ids)


def use_process_device() -> torch.device:
    """`process_device`, made the current CUDA device too (before NCCL starts: a communicator binds to it)."""
    device = process_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
