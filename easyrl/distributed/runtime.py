"""Starting (or joining) Ray from the driver."""

from __future__ import annotations

import logging
import os
from typing import Any


__all__ = ["default_worker_env", "init_ray"]

logger = logging.getLogger(__name__)


def default_worker_env(use_gpu: bool | None = None) -> dict[str, str]:
    """Environment variables every worker gets by default.

    ``TOKENIZERS_PARALLELISM=false`` (tokenizers forked into many processes warn and deadlock otherwise), and on
    CPU-only machines ``OMP_NUM_THREADS=1`` / ``MKL_NUM_THREADS=1`` so that several worker processes do not
    oversubscribe the cores.
    """
    if use_gpu is None:
        try:
            import torch

            use_gpu = torch.cuda.is_available()
        except ImportError:  # pragma: no cover - torch is a dependency
            use_gpu = False
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not use_gpu:
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


def init_ray(
    num_cpus: int | None = None,
    env_vars: dict[str, str] | None = None,
    *,
    num_gpus: int | None = None,
    address: str | None = None,
    log_to_driver: bool = True,
    **ray_kwargs: Any,
) -> bool:
    """Start a local Ray instance (or join ``address`` / ``RAY_ADDRESS``) unless Ray is already initialized.

    Args:
        num_cpus: CPUs Ray may schedule on (``None``: all of the machine's).
        env_vars: extra environment variables for every worker process, on top of :func:`default_worker_env`
            (a value given here wins). They go through the job's ``runtime_env``, which per-actor ``env_vars`` of a
            :class:`~easyrl.distributed.WorkerGroup` extend.
        num_gpus: GPUs Ray may schedule on (``None``: autodetect).
        address: a running cluster to join; ``None`` starts a local instance unless ``RAY_ADDRESS`` is set.
        log_to_driver: forward the workers' stdout/stderr to the driver.
        ray_kwargs: anything else for :func:`ray.init`.

    Returns:
        ``True`` if this call initialized Ray, ``False`` if it was already initialized.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env = default_worker_env(use_gpu=bool(num_gpus) if num_gpus is not None else None)
    env.update(env_vars or {})
    runtime_env = dict(ray_kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env, **dict(runtime_env.get("env_vars") or {})}
    address = address or os.environ.get("RAY_ADDRESS") or None
    init_args: dict[str, Any] = {
        "address": address,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": log_to_driver,
        "runtime_env": runtime_env,
    }
    if address is None:
        init_args["num_cpus"] = num_cpus
        init_args["num_gpus"] = num_gpus
    init_args.update(ray_kwargs)
    ray.init(**init_args)
    logger.info("Ray initialized: %s", ray.cluster_resources())
    return True
