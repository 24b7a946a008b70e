"""Errors raised on the driver when a worker of a :class:`~easyrl.distributed.WorkerGroup` fails."""

from __future__ import annotations


__all__ = [
    "ClusterUnreachableError",
    "ResourceUnavailableError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroupError",
    "WorkerTimeoutError",
]


class WorkerGroupError(RuntimeError):
    """Base class of every failure of a worker group seen from the driver."""


class WorkerError(WorkerGroupError):
    """A worker method raised an exception.

    Attributes:
        role: the role of the group (``"actor"``, ``"ref"``, ``"critic"``, ...).
        rank: the rank whose method raised.
        summary: the tail of the remote traceback.
    """

    def __init__(self, role: str, rank: int, summary: str) -> None:
        self.role = role
        self.rank = rank
        self.summary = summary
        super().__init__(f"the {role} worker of rank {rank} raised an exception:\n{summary}")


class WorkerDiedError(WorkerGroupError):
    """A worker process died (killed, crashed, out of memory, ``os._exit``...).

    Attributes:
        role: the role of the group the dead worker belonged to.
        rank: the rank of the dead worker.
        cause: what Ray said about the death.
    """

    def __init__(self, role: str, rank: int, cause: str) -> None:
        self.role = role
        self.rank = rank
        self.cause = cause
        super().__init__(f"the {role} worker of rank {rank} died: {cause}")


class WorkerTimeoutError(WorkerGroupError):
    """A call to a worker group did not finish within its ``timeout_s``.

    The workers keep running the method; the group should be shut down.
    """

    def __init__(self, role: str, method: str, timeout_s: float | None = None) -> None:
        self.role = role
        self.method = method
        self.timeout_s = timeout_s
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        super().__init__(f"the call of {method!r} on the {role} workers timed out{after}")


class ResourceUnavailableError(RuntimeError):
    """The Ray cluster cannot provide the resources a :class:`~easyrl.distributed.ResourcePool` asks for."""


class ClusterUnreachableError(ResourceUnavailableError):
    """The Ray cluster address given (``RAY_ADDRESS`` or ``address``) answers nothing: its message names which one
    and how to fix it. A distributed error, not a configuration one, so this room imports nothing of the config."""
