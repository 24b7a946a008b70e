"""Single-controller distribution: a Ray driver drives groups of worker processes, one per GPU (or CPU slot).

* :class:`ResourcePool` reserves one placement-group bundle per rank.
* :class:`WorkerGroup` starts one Ray actor per bundle from a plain worker class; methods declared with
  :func:`register` (see :class:`Dispatch`) are called on every rank from the driver.
* Worker deaths and errors surface on the driver as :class:`WorkerDiedError` / :class:`WorkerError` /
  :class:`WorkerTimeoutError` instead of hangs (see :mod:`easyrl.distributed.liveness`); a frozen worker (no
  heartbeat) as :class:`WorkerFrozenError`, with every rank's stack written out (:mod:`easyrl.distributed.hang_watch`).
* :func:`init_ray` starts Ray for a driver; :func:`init_distributed` sets up ``torch.distributed`` in a worker.
"""

from easyrl.distributed.dispatch import Dispatch, merge_metrics, register
from easyrl.distributed.errors import (
    ResourceUnavailableError,
    WorkerCallInterrupted,
    WorkerDiedError,
    WorkerError,
    WorkerFrozenError,
    WorkerGroupError,
    WorkerTimeoutError,
)
from easyrl.distributed.liveness import check_alive
from easyrl.distributed.resource_pool import ResourcePool
from easyrl.distributed.runtime import default_worker_env, init_ray
from easyrl.distributed.torch_dist import DistInfo, dist_info, init_distributed
from easyrl.distributed.worker_group import GroupCall, WorkerGroup


__all__ = [
    "Dispatch",
    "DistInfo",
    "GroupCall",
    "ResourcePool",
    "ResourceUnavailableError",
    "WorkerCallInterrupted",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFrozenError",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerTimeoutError",
    "check_alive",
    "default_worker_env",
    "dist_info",
    "init_distributed",
    "init_ray",
    "merge_metrics",
    "register",
]
