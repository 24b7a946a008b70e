"""Errors raised on the driver when a worker of a :class:`~easyrl.distributed.WorkerGroup` fails."""

from __future__ import annotations


__all__ = [
    "ClusterUnreachableError",
    "ResourceUnavailableError",
    "WorkerCallInterrupted",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFrozenError",
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


class WorkerFrozenError(WorkerGroupError):
    """A worker stopped answering (no heartbeat) while the driver waited on a call: a process stopped by SIGSTOP, or
    stuck on a device or file system. Every rank's Python stack was written to ``stacks``.

    Attributes:
        role: the role of the frozen worker's group.
        rank: the frozen rank.
        method: the call the driver was waiting on (of ``waited_role``'s group, which may be another group).
        silent_s: seconds since the rank's last heartbeat.
        stacks: the report holding every rank's stack.
    """

    def __init__(self, role: str, rank: int, method: str, waited_role: str, silent_s: float, stacks: str) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.silent_s = silent_s
        self.stacks = stacks
        super().__init__(
            f"the {role} worker of rank {rank} is frozen (no heartbeat for {silent_s:.0f} s: stopped by SIGSTOP, or "
            f"stuck on a device or file system) while the driver waited on {method!r} of the {waited_role} workers; "
            f"every rank's Python stack is in {stacks} (bound: trainer.hang_timeout_s)"
        )


class WorkerCallInterrupted(WorkerGroupError):
    """A stop signal came while the driver waited on a call that did not end within the stop's grace: the run stops
    without waiting for it (nothing can be saved while the workers are still in the call).

    Attributes:
        role: the role of the called group.
        method: the call left running.
        signal_name: the signal that asked for the stop.
    """

    def __init__(self, role: str, method: str, signal_name: str, grace_s: float) -> None:
        self.role = role
        self.method = method
        self.signal_name = signal_name
        super().__init__(
            f"{signal_name}: the call of {method!r} on the {role} workers did not end within {grace_s:g} s "
            "(trainer.stop_grace_s), so the run stopped without waiting for it and without saving"
        )


class ResourceUnavailableError(RuntimeError):
    """The Ray cluster cannot provide the resources a :class:`~easyrl.distributed.ResourcePool` asks for."""


class ClusterUnreachableError(ResourceUnavailableError):
    """The Ray cluster address given (``RAY_ADDRESS`` or ``address``) answers nothing: its message names which one
    and how to fix it. A distributed error, not a configuration one, so this room imports nothing of the config."""
