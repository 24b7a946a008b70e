"""A group of Ray actors, one per rank, driven from the single controller.

The worker class is a plain Python class; its methods decorated with :func:`~easyrl.distributed.register` become
methods of the group, which call every rank and gather the results as their dispatch mode says::

    group = WorkerGroup(MyWorker, pool, "actor", model_path, num_cpus_per_worker=0.5, num_gpus_per_worker=0.5)
    out = group.compute_log_probs(batch)  # DP_SPLIT: split over the ranks, concatenated back
    handle = group.submit(MyWorker.compute_log_probs, batch)  # started at once; mypy checks the arguments
    out = handle.result()
    group.shutdown()
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from easyrl.distributed import hang_watch, liveness
from easyrl.distributed.dispatch import (
    Dispatch,
    DispatchSpec,
    collect_dp_results,
    merge_metrics,
    registered_methods,
    split_grouped_args,
)
from easyrl.distributed.errors import WorkerError
from easyrl.distributed.hang_watch import HangWatch
from easyrl.distributed.resource_pool import ResourcePool


__all__ = ["GroupCall", "WorkerGroup", "pick_free_port"]

logger = logging.getLogger(__name__)

W = TypeVar("W")
P = ParamSpec("P")

_used_ports: set[int] = set()
_ports_lock = threading.Lock()


def _bind_free_port() -> int:
    """A TCP port free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))  # port 0: the OS picks a free one
        return int(sock.getsockname()[1])


def pick_free_port() -> int:
    """A free TCP port on this host, never one this process handed out before (several groups start at once)."""
    with _ports_lock:
        for _ in range(100):
            port = _bind_free_port()
            # The socket closes on return: the OS may offer the port again before torch binds it. Never hand it twice.
            if port not in _used_ports:
                _used_ports.add(port)
                return port
    raise RuntimeError("could not find a free TCP port")


def _free_port_on(node_id: str) -> int:
    """A free TCP port on the Ray node ``node_id`` (a zero-resource task pinned to it when it is another host)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not node_id or node_id == ray.get_runtime_context().get_node_id():
        return pick_free_port()
    task = ray.remote(num_cpus=0)(_bind_free_port)  # zero CPUs: it runs even when the node's CPUs are all reserved
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return int(ray.get(task.options(scheduling_strategy=strategy).remote(), timeout=120))


class GroupCall:
    """A call running on every rank of a group; :meth:`result` waits for it and gathers the ranks' results."""

    def __init__(
        self, group: WorkerGroup, method: str, spec: DispatchSpec, refs: list[Any], timeout_s: float | None
    ) -> None:
        self.group = group
        self.method = method
        self.spec = spec
        self._refs = refs
        self._timeout_s = timeout_s
        self._started_at = time.monotonic()  # a stop requested after this gives up the wait once its grace passed
        self._deadline = None if timeout_s is None else self._started_at + timeout_s
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not); does not block."""
        import ray

        if self._done:
            return True
        # timeout=0: a poll, never blocks
        ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self) -> Any:
        """Wait for every rank and return the gathered result (see :class:`~easyrl.distributed.Dispatch`).

        Raises:
            WorkerDiedError: a worker of this group, or of another live group, died meanwhile.
            WorkerError: the method raised on some rank. The first rank to raise is reported, without waiting
                for the others; if some of them are still running the call then, the group is shut down.
            WorkerTimeoutError: the call's ``timeout_s`` passed.
            WorkerFrozenError: a worker of any live group stopped beating (its stacks are written out).
            WorkerCallInterrupted: a stop signal came after the call started and its grace passed.
        """
        if not self._done:
            try:
                results = liveness.wait_for_results(
                    self._refs,
                    self.group.role,
                    self.method,
                    timeout_s=self._timeout_s,
                    deadline=self._deadline,
                    started_at=self._started_at,
                )
                self._value = self._gather(results)
            except WorkerError as exc:
                self._error = self._stop_ranks_left_behind(exc)
                self._done = True
                raise self._error from exc.__cause__  # Ray's error stays the cause
            except Exception as exc:  # a KeyboardInterrupt leaves the call waitable again
                self._error = exc
                self._done = True
                raise
            self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def _stop_ranks_left_behind(self, error: WorkerError) -> WorkerError:
        """Shut the group down when ranks are still running the call that failed on ``error.rank``.

        Those ranks are usually blocked in a collective (an FSDP all-gather, a gradient reduce-scatter) that the
        failed rank will never join: they would sit there until the process group's timeout (30 min by default),
        holding their devices, and every later call to them would queue behind it. Nothing is lost by stopping
        them: their state already differs from the failed rank's (some ranks stepped, one did not). When every
        rank has finished (the error did not strand anyone), the group stays usable.
        """
        import ray

        if error.role != self.group.role:  # another group's failure, seen while waiting on this one
            return error
        _, running = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        if not running:
            return error
        left = sorted(rank for rank, ref in enumerate(self._refs) if ref in running)
        logger.error(
            "rank %d of the %s workers raised in %s while rank(s) %s were still in it: stopping the group",
            error.rank,
            self.group.role,
            self.method,
            left,
        )
        self.group.shutdown()
        note = (
            f"(rank(s) {left} were still running {self.method!r}, probably waiting for rank {error.rank} in a "
            f"collective: the {self.group.role} workers were stopped)"
        )
        return WorkerError(error.role, error.rank, f"{error.summary}\n{note}")

    def _gather(self, results: list[Any]) -> Any:
        if self.spec.dispatch is Dispatch.RANK0:
            return results[0]
        if self.spec.dispatch is Dispatch.ALL_MERGED:
            return merge_metrics(results)
        if self.spec.dispatch is Dispatch.DP_SPLIT:
            # a group's ranks return the same rows: keep the first
            return collect_dp_results(results[:: self.group.ranks_per_dp])
        if self.spec.dispatch is Dispatch.ENGINE_SPLIT:
            # an engine's ranks return the same rows
            return collect_dp_results(results[:: self.group.ranks_per_engine])
        return results

    def __repr__(self) -> str:
        return f"GroupCall({self.group.role}.{self.method}, done={self._done})"


class GroupFront(Generic[W]):
    """How a group of workers is called, the same under every backend (Ray's `WorkerGroup`, the inline one): its
    declared methods by name (`call_async`, `call`, `group.compute_log_probs(...)`) or by the worker class's method
    itself (`submit`, which mypy checks), and one line naming an undeclared one. A backend sets `role`, `worker_cls`
    and `_methods` and starts a call in `_start`."""

    role: str
    worker_cls: type[W]
    _methods: dict[str, DispatchSpec]

    @property
    def methods(self) -> dict[str, Dispatch]:
        """The callable methods of this group and their dispatch modes."""
        return {name: spec.dispatch for name, spec in self._methods.items()}

    def _start(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float | None) -> GroupCall:
        raise NotImplementedError

    def call_async(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> GroupCall:
        """Start ``method`` on every rank and return at once; ``.result()`` waits and gathers.

        Args:
            method: the name of a method declared with :func:`~easyrl.distributed.register`.
            args: positional arguments (for ``DP_SPLIT``, the first one is the batch to split).
            timeout_s: the total timeout of this call, from now (default: the group's ``call_timeout_s``).
            kwargs: keyword arguments, the same on every rank.
        """
        return self._start(method, args, kwargs, timeout_s)

    def submit(self, method: Callable[Concatenate[W, P], Any], *args: P.args, **kwargs: P.kwargs) -> GroupCall:
        """:meth:`call_async` by the worker class's method itself (``group.submit(ActorWorker.generate, rows, p)``),
        not its name: mypy checks that the method is the group's worker class's and the arguments are its own."""
        name = getattr(method, "__name__", "")
        if getattr(self.worker_cls, name, None) is not method:  # e.g. another role's method of the same name
            raise AttributeError(f"{method!r} is not a method of {self.worker_cls.__name__} (the {self.role} group)")
        return self._start(name, args, kwargs, None)  # the group's call_timeout_s

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``method`` on every rank and wait for the gathered result (see :meth:`call_async`)."""
        return self.call_async(method, *args, timeout_s=timeout_s, **kwargs).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        methods = self.__dict__.get("_methods", {})
        if name in methods:
            return functools.partial(self.call, name)
        raise AttributeError(self._undeclared(name))

    def _undeclared(self, name: str) -> str:
        cls = self.__dict__.get("worker_cls")
        cls_name = cls.__name__ if cls is not None else "the worker class"
        if cls is not None and callable(getattr(cls, name, None)):
            return f"{cls_name}.{name} is not declared with @register(dispatch=...): it cannot be called on the group"
        return f"{cls_name} has no method {name!r} declared with @register(dispatch=...)"


class WorkerGroup(GroupFront[W]):
    """``pool.world_size`` Ray actors of ``worker_cls``, actor ``i`` on bundle ``i`` of ``pool``; the group is typed
    by its worker class (``WorkerGroup[ActorWorker]``), so :meth:`submit` checks a call's method and arguments.

    Args:
        worker_cls: a plain Python class (the group wraps it with ``ray.remote``); its ``__init__`` gets
            ``init_args`` / ``init_kwargs``. It sets up ``torch.distributed`` itself, e.g. by calling
            :func:`~easyrl.distributed.init_distributed` in ``__init__``.
        pool: the placement group to run on.
        role: the name of this group (``"actor"``, ``"ref"``, ``"critic"``, ``"rollout"``...), in errors and in
            the workers' ``EASYRL_ROLE``.
        num_cpus_per_worker: CPUs each actor takes from its bundle (fractions let groups share bundles).
        num_gpus_per_worker: GPUs each actor takes from its bundle (0 on CPU pools).
        env: extra environment variables for the workers.
        call_timeout_s: the default total timeout of a call (``None``: no timeout).
        init_timeout_s: how long the actors may take to start (their ``__init__`` included).
        hang_timeout_s: a worker whose heartbeat stops this long while the driver waits is frozen: every rank's
            stack is written to ``stack_dir`` and the wait raises :class:`~easyrl.distributed.WorkerFrozenError`
            (``None``: no heartbeat).
        stack_dir: where the stack files go (default: ``<tmp>/easyrl-stacks-<driver pid>``).
        ranks_per_engine: consecutive ranks that share one tensor-parallel rollout engine (``ENGINE_SPLIT`` calls
            give them the same chunk and keep the first one's result).
        ranks_per_dp: consecutive ranks that hold the same samples (a sequence-parallel group, ``ulysses_size``):
            ``DP_SPLIT`` calls split the batch over ``world_size // ranks_per_dp`` groups, give every rank of a
            group the group's chunk and keep the group's first result.

    Each worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``EASYRL_ROLE``; the port is picked for this group, so several groups sharing a pool each have their own
    ``torch.distributed`` world.
    """

    def __init__(
        self,
        worker_cls: type[W],
        pool: ResourcePool,
        role: str,
        *init_args: Any,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        env: dict[str, str] | None = None,
        call_timeout_s: float | None = None,
        init_timeout_s: float | None = 600.0,
        hang_timeout_s: float | None = 120.0,
        stack_dir: str | None = None,
        ranks_per_engine: int = 1,
        ranks_per_dp: int = 1,
        **init_kwargs: Any,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not isinstance(worker_cls, type) or isinstance(worker_cls, ray.actor.ActorClass):
            raise TypeError(f"worker_cls must be a plain Python class (not a Ray actor class), got {worker_cls!r}")
        self.role = role
        self.pool = pool
        self.world_size = pool.world_size
        for name, size in (("ranks_per_engine", ranks_per_engine), ("ranks_per_dp", ranks_per_dp)):
            if size < 1 or self.world_size % size:
                raise ValueError(f"{name}={size} must divide the {role} world size {self.world_size}")
        self.ranks_per_engine, self.ranks_per_dp = ranks_per_engine, ranks_per_dp
        self.worker_cls = worker_cls
        self.call_timeout_s = call_timeout_s
        self._methods: dict[str, DispatchSpec] = registered_methods(worker_cls)
        self._init_watch(stack_dir)

        self.master_addr = pool.rendezvous_host()
        # free on rank 0's node, where the rendezvous store listens
        self.master_port = _free_port_on(pool.bundle_node_ids[0])
        local_ranks = pool.local_ranks()
        remote_cls: Any = ray.remote(worker_cls)
        self._actors: list[Any] = []
        for rank in range(self.world_size):
            worker_env = {
                **(env or {}),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_ranks[rank]),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "EASYRL_ROLE": role,
            }
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pool.placement_group, placement_group_bundle_index=rank
            )
            actor = remote_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": worker_env},
                max_restarts=0,  # a restarted rank would have lost its process group and model: fail loudly
            ).remote(*init_args, **init_kwargs)
            self._actors.append(actor)
        liveness.register_group(self)
        try:
            ready = [actor.__ray_ready__.remote() for actor in self._actors]  # resolves once __init__ has run
            deadline = None if init_timeout_s is None else time.monotonic() + init_timeout_s
            liveness.wait_for_results(ready, role, "__init__", timeout_s=init_timeout_s, deadline=deadline)
            if hang_timeout_s is not None:
                self._arm(hang_timeout_s)
        except BaseException:  # Ctrl-C during startup too: never leave actors behind
            self.shutdown()
            raise
        logger.info(
            "started %d %s workers (%s) rendezvous %s:%d",
            self.world_size,
            role,
            worker_cls.__name__,
            self.master_addr,
            self.master_port,
        )

    # ----------------------------------------------------------------------------------------------- calling
    def _start(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float | None) -> GroupCall:
        if self._closed:
            raise RuntimeError(f"the {self.role} worker group is shut down")
        spec = self._methods.get(method)
        if spec is None:
            raise AttributeError(self._undeclared(method))
        if spec.dispatch is Dispatch.DP_SPLIT:
            per_rank = split_grouped_args(self.world_size, self.ranks_per_dp, args, kwargs)
        elif spec.dispatch is Dispatch.ENGINE_SPLIT:
            per_rank = split_grouped_args(self.world_size, self.ranks_per_engine, args, kwargs)
        else:
            per_rank = [(tuple(args), dict(kwargs))] * self.world_size
        import ray

        # Put shared arguments in the object store once instead of once per rank.
        if spec.dispatch in (Dispatch.ALL, Dispatch.ALL_MERGED, Dispatch.RANK0) and self.world_size > 1:
            shared_args = tuple(ray.put(a) if _is_large(a) else a for a in args)
            per_rank = [(shared_args, dict(kwargs))] * self.world_size
        refs = [
            getattr(actor, method).remote(*rank_args, **rank_kwargs)
            for actor, (rank_args, rank_kwargs) in zip(self._actors, per_rank, strict=True)
        ]
        return GroupCall(self, method, spec, refs, self.call_timeout_s if timeout_s is None else timeout_s)

    def check_alive(self) -> None:
        """Raise if a worker of any live group is known dead (does not block)."""
        liveness.check_alive()

    # ---------------------------------------------------------------------------------------------- liveness
    def _init_watch(self, stack_dir: str | None) -> None:
        """The liveness state: pings in flight, ranks known dead, the heartbeats (once armed), the stack folder."""
        self._lock = threading.Lock()
        self._closed = False
        self._pings: list[Any | None] = [None] * self.world_size
        self._ping_sent: list[float] = [0.0] * self.world_size
        self._failures: dict[int, BaseException] = {}
        self.stack_dir = stack_dir or os.path.join(tempfile.gettempdir(), f"easyrl-stacks-{os.getpid()}")
        self._watch: HangWatch | None = None

    def _arm(self, hang_timeout_s: float) -> None:
        """Start every rank's heartbeat and stack dump on signal (:mod:`easyrl.distributed.hang_watch`)."""
        keys = [f"{self.role}-{id(self):x}-{os.getpid()}-{rank}" for rank in range(self.world_size)]
        paths = [os.path.join(self.stack_dir, f"{self.role}_rank{rank}.stack") for rank in range(self.world_size)]
        refs = [
            actor.__ray_call__.remote(hang_watch.arm, key, path)
            for actor, key, path in zip(self._actors, keys, paths, strict=True)
        ]
        armed = liveness.wait_for_results(
            refs, self.role, "arm (heartbeat)", timeout_s=60, deadline=time.monotonic() + 60
        )
        ranks = [
            hang_watch.Rank(key, int(pid), str(node), path)
            for key, path, (pid, node) in zip(keys, paths, armed, strict=True)
        ]
        self._watch = hang_watch.HangWatch(self.role, ranks, hang_timeout_s)

    def _frozen_rank(self) -> tuple[int, float] | None:
        """(rank, seconds without a heartbeat) of a frozen rank not known dead, if any (used by the wait loop)."""
        if self._watch is None or self._closed:
            return None
        with self._lock:
            dead = set(self._failures)
        return self._watch.frozen(dead)

    def _armed_ranks(self) -> list[tuple[int, hang_watch.Rank]]:
        """Every armed rank not known dead, for a stack dump."""
        if self._watch is None or self._closed:
            return []
        with self._lock:
            dead = set(self._failures)
        return [(index, rank) for index, rank in enumerate(self._watch.ranks) if index not in dead]

    def _liveness_refs(self) -> dict[Any, int]:
        """The outstanding pings of this group, by ref, after re-sending those due (used by the wait loop)."""
        now = time.monotonic()
        out: dict[Any, int] = {}
        with self._lock:
            if self._closed:
                return out
            for rank, actor in enumerate(self._actors):
                if rank in self._failures:
                    continue
                # At most one ping in flight per rank, and no sooner than a tick after the last one was sent.
                if self._pings[rank] is None and now - self._ping_sent[rank] >= liveness.PING_INTERVAL_S:
                    self._pings[rank] = actor.__ray_ready__.remote()
                    self._ping_sent[rank] = now
                ping = self._pings[rank]
                if ping is not None:
                    out[ping] = rank
        return out

    def _ping_done(self, rank: int, ref: Any, error: BaseException | None) -> None:
        """Record a finished ping of ``rank``; ``error`` when it failed (the actor is gone)."""
        with self._lock:
            if self._pings[rank] is ref:  # not a ping that shutdown() already dropped
                self._pings[rank] = None
            if error is not None and not self._closed:  # after shutdown, failures are our own kills
                self._failures.setdefault(rank, error)

    def _first_failure(self) -> tuple[int, BaseException] | None:
        """The lowest rank known dead and the error of its failed ping, if any."""
        with self._lock:
            if self._closed or not self._failures:
                return None
            rank = min(self._failures)
            return rank, self._failures[rank]

    # ---------------------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Kill the actors (idempotent). Running calls fail; the pool stays reserved."""
        import ray

        with self._lock:
            if self._closed:
                return
            self._closed = True  # under the lock: concurrent shutdowns kill once
        liveness.unregister_group(self)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead or Ray shut down
                logger.debug("killing a %s worker failed", self.role, exc_info=True)
        self._pings = [None] * self.world_size
        logger.info("shut down the %s workers", self.role)

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "live"
        return (
            f"WorkerGroup(role={self.role!r}, cls={self.worker_cls.__name__}, world_size={self.world_size}, {state})"
        )


def _is_large(value: Any) -> bool:
    """Whether an argument is worth one ``ray.put`` shared by every rank (tensors, arrays, batches)."""
    if isinstance(value, (int, float, str, bool, type(None))):
        return False
    # arrays (nbytes), batches (chunk), tensors (element_size)
    return hasattr(value, "nbytes") or hasattr(value, "chunk") or hasattr(value, "element_size")
