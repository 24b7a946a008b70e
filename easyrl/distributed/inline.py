"""The inline backend: a role's worker built in the driver's own process, behind the interface of a `WorkerGroup`.

Where every role is one rank on this node and nothing needs a process of its own (`trainer.backend`, decided in the
run plan), a Ray driver, one worker process per role and Ray's own processes only cost start-up time and memory. An
:class:`InlineGroup` builds the same worker class in the driver's process instead and answers the same calls: the
methods declared with :func:`~easyrl.distributed.register`, by name (``group.update_actor(batch)``), through
``call_async`` / ``submit`` (a handle with ``result()`` and ``done()``), ``methods``, ``check_alive`` and
``shutdown``. The driver cannot tell the two apart, so it never branches on the backend.

What a Ray worker process has of its own, an inline worker gets around each of its calls, and the driver gets its
own back afterwards (:class:`RoleProcess`):

* its environment: ``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``EASYRL_ROLE``, the variables every Ray worker
  gets (`default_worker_env`, `local_only_env`) and the engine's (`engine_env`);
* its random generators (Python's, NumPy's, torch's CPU and, once CUDA is up, CUDA's): a worker seeds them in its
  ``__init__`` (`setup_process`) and draws from them in its methods; the driver's draws and the other roles' never
  interleave with them, as they do not across processes;
* its torch thread count (a Ray worker starts at 1 from ``OMP_NUM_THREADS``; `setup_process` sets it on CPU);
* arguments and results by value (deep copies, as Ray's serialization makes them): a worker that writes into a batch
  it was given, or a driver that writes into a result, changes nothing on the other side.

The process group is world size 1 over an in-memory store (no port), made once for the first inline group and
destroyed with the last. A call runs to its end inside ``call_async`` / ``submit``, in the caller's thread: a
``breakpoint()`` in a loss or an environment stops there, and ``done()`` is always true. A method's exception is
raised by ``result()`` as the same :class:`~easyrl.distributed.WorkerError` naming the role that Ray's path raises.
What inline gives up: a call cannot be timed out (``timeout_s`` and ``worker.timeout`` are not enforced: a hung
method hangs the run, Ctrl-C stops it), and nothing runs beside the driver (Ray's calls started without waiting do).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import logging
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from easyrl import signals
from easyrl.distributed.device import use_process_device
from easyrl.distributed.dispatch import Dispatch, DispatchSpec, registered_methods, split_grouped_args
from easyrl.distributed.errors import WorkerCallInterrupted, WorkerError
from easyrl.distributed.runtime import default_worker_env, local_only_env
from easyrl.distributed.worker_group import GroupCall, GroupFront


__all__ = ["INLINE_ENV", "InlineCall", "InlineGroup", "InlinePool", "RoleProcess"]

logger = logging.getLogger(__name__)

W = TypeVar("W")

INLINE_ENV = "EASYRL_BACKEND"
"""Set to ``inline`` in an inline worker's environment: `easyrl.distributed.device` then picks the device as a
single process does (``LOCAL_RANK``), not from Ray's GPU ids (there is no Ray)."""

# One worker call at a time in this process: the environment, generators and thread count are process-wide, and a
# call swaps them in and out (a Ray worker runs one call at a time too).
_call_lock = threading.RLock()
_live_groups: set[int] = set()
_made_process_group = False


class InlinePool:
    """Stands where a `ResourcePool` stands for an inline run: one rank, on this process.

    Args:
        use_gpu: the workers train on the GPU this process sees.
        env: environment variables every worker gets (the engine's, `engine_env`), on top of what a Ray worker
            gets by default.
    """

    world_size = 1

    def __init__(self, use_gpu: bool, env: dict[str, str] | None = None) -> None:
        self.use_gpu = use_gpu
        self.env = {**default_worker_env(use_gpu), **local_only_env(), **(env or {})}

    def remove(self) -> None:
        """Nothing is reserved: there is nothing to release."""

    def __repr__(self) -> str:
        return f"InlinePool(use_gpu={self.use_gpu})"


class RoleProcess:
    """What a worker process has of its own, kept for one inline role and swapped in around each of its calls."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        # A Ray worker starts at one torch thread (OMP_NUM_THREADS=1, ours on CPU, Ray's own default on GPU);
        # `setup_process` raises it on CPU.
        self.threads = 1
        # A new process's generators: Python's and NumPy's seeded from the OS, torch's at its fixed default seed.
        # CUDA's joins once CUDA is up: the role's `__init__` seeds it (`torch.manual_seed` seeds every device).
        self.rng: dict[str, Any] = {
            "python": random.Random().getstate(),
            "numpy": np.random.RandomState().get_state(),
            "torch": torch.Generator().manual_seed(_TORCH_DEFAULT_SEED).get_state(),
        }

    def __enter__(self) -> RoleProcess:
        self._saved_env = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        self._saved_rng = _rng_state()
        _set_rng_state(self.rng)
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc: object) -> None:
        self.rng, self.threads = _rng_state(), torch.get_num_threads()
        # The driver's CUDA generator is restored only when CUDA was up before the call (else there was none to save).
        _set_rng_state(self._saved_rng)
        torch.set_num_threads(self._saved_threads)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_TORCH_DEFAULT_SEED = 67280421310721
"""The seed of torch's default generator in every new process."""


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # asking earlier would start CUDA
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def _by_value(value: Any) -> Any:
    """A copy of ``value`` as Ray's serialization would hand it over (nothing shared with the sender).

    Copied at one torch thread: a tensor's deepcopy copies its storage as bytes (4-8x the tensor's elements), enough
    for torch to split each copy over its thread pool, and waking the pool for each of a batch's ~30 tensors is what
    the copy cost. Measured 2026-11-28 on the 2-core machine under load (28 tensors of 128 x 76, the demo's batch):
    93 ms of CPU and 600 ms of wall time at 2 threads, 1.7 ms and 9.5 ms at one. The copy's bytes are the same.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        return copy.deepcopy(value)
    torch.set_num_threads(1)
    try:
        return copy.deepcopy(value)
    finally:
        torch.set_num_threads(threads)  # the call (or the driver) computes with its own thread count


def _worker_error(role: str, exc: BaseException) -> WorkerError:
    """The `WorkerError` Ray's path raises for ``exc`` (`liveness.to_group_error`): the tail of its traceback, or its
    one line where the exception's message names the culprit itself (``one_line``), naming the role and rank 0."""
    if getattr(exc, "one_line", False):
        error = WorkerError(role, 0, f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    error = WorkerError(role, 0, "\n".join([line for line in lines if line.strip()][-20:]))
    error.__cause__ = exc  # raised from the worker's own exception: its traceback stays whole
    return error


def _init_process_group(use_gpu: bool) -> None:
    """The default process group of world size 1 over an in-memory store (no port), once per process."""
    global _made_process_group
    if dist.is_initialized():
        return
    if use_gpu:
        use_process_device()  # before NCCL starts: a communicator binds to the current device
    backend = "nccl" if use_gpu else "gloo"
    timeout = datetime.timedelta(seconds=1800)  # `init_distributed`'s: nothing waits on a peer in a world of one
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _made_process_group = True


def _release_process_group() -> None:
    """Destroy the process group the inline groups made once none of them is left (a later run makes its own)."""
    global _made_process_group
    if _made_process_group and not _live_groups and dist.is_initialized():
        dist.destroy_process_group()
        _made_process_group = False


class _StopWatch:
    """A stop signal honoured while an inline call runs, as Ray's wait honours it (`liveness._check_stop`): a call
    started before the stop request that is still running once the stop's grace (`trainer.stop_grace_s`) has passed
    is interrupted, and raises `WorkerCallInterrupted`. Under Ray the driver merely stops waiting; inline the call runs
    in the driver's own thread, so a watcher thread sends the stop signal to it again (`signal.pthread_kill`),
    and the stop handler's second-signal path raises `KeyboardInterrupt` inside the call. Calls started after the
    request (the save's own) are never cut off. A call blocked inside C code is interrupted when it returns to Python.
    """

    POLL_S = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: tuple[object, float] | None = None  # (the call's token, when it started)
        self._fired: object | None = None  # the token of the call the watcher interrupted
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, role: str, method: str) -> Iterator[None]:
        token = object()
        with self._lock:
            self._running = (token, time.monotonic())
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="easyrl-inline-stop", daemon=True)
                self._thread.start()
        try:
            try:
                yield
            finally:
                with self._lock:
                    self._running = None
        except KeyboardInterrupt:
            stop = signals.stop_requested()
            if self._fired is not token or stop is None:
                raise  # Ctrl-C twice, a debugger's quit: as it is
            self._fired = None
            raise WorkerCallInterrupted(role, method, stop[1], stop[2]) from None

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            stop = signals.stop_requested()
            with self._lock:
                if self._running is None or stop is None or self._fired is self._running[0]:
                    continue
                token, started = self._running
                requested_at, name, grace_s = stop
                if started < requested_at and time.monotonic() >= requested_at + grace_s:
                    self._fired = token
                    # A real signal, not `_thread.interrupt_main`: only a signal wakes a main thread blocked in a
                    # system call (a sleep, a lock, a read); the handler then sees a second signal and raises.
                    main = threading.main_thread().ident
                    if main is not None:
                        signal.pthread_kill(main, signal.Signals[name])


_stop_watch = _StopWatch()


class InlineCall(GroupCall):
    """A call that has run already (inline calls run when started): :meth:`result` returns its gathered result or
    raises its `WorkerError`."""

    def __init__(
        self, group: InlineGroup[Any], method: str, spec: DispatchSpec, value: Any, error: WorkerError | None
    ) -> None:
        self.group = group  # type: ignore[assignment]  # `_gather` reads only its rank grouping (one rank)
        self.method = method
        self.spec = spec
        self._done = True
        self._error = error
        # gathered as Ray's path gathers the ranks' results, here one
        self._value = None if error is not None else self._gather([value])

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        if self._error is not None:
            raise self._error from self._error.__cause__
        return self._value

    def __repr__(self) -> str:
        return f"InlineCall({self.group.role}.{self.method}, done=True)"


class InlineGroup(GroupFront[W]):
    """One ``worker_cls`` built in this process, called as a one-rank `WorkerGroup` is; the same arguments as
    `WorkerGroup` (the Ray-only ones, CPUs and GPUs per worker and the start timeout, are accepted and unused).

    Raises:
        WorkerError: the worker's ``__init__`` raised (naming the role, as Ray's path does).
    """

    def __init__(
        self,
        worker_cls: type[W],
        pool: InlinePool,
        role: str,
        *init_args: Any,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        env: dict[str, str] | None = None,
        call_timeout_s: float | None = None,
        init_timeout_s: float | None = 600.0,
        ranks_per_engine: int = 1,
        ranks_per_dp: int = 1,
        hang_timeout_s: float | None = None,
        stack_dir: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        del num_cpus_per_worker, num_gpus_per_worker, init_timeout_s  # Ray's placement and start-up only
        # A worker's heartbeat tells the driver a separate process froze; inline the driver is that process, and
        # its own stack is the one a user sees (a hang there is the terminal's to interrupt, SIGINT included).
        del hang_timeout_s, stack_dir
        if not isinstance(worker_cls, type):
            raise TypeError(f"worker_cls must be a plain Python class, got {worker_cls!r}")
        if ranks_per_engine != 1 or ranks_per_dp != 1:
            raise ValueError(
                f"the inline {role} group is one rank: ranks_per_engine={ranks_per_engine} and "
                f"ranks_per_dp={ranks_per_dp} need several; use trainer.backend: ray"
            )
        self.role = role
        self.pool = pool
        self.world_size = 1
        self.ranks_per_engine = self.ranks_per_dp = 1
        self.worker_cls = worker_cls
        self.call_timeout_s = call_timeout_s  # kept for the interface: an inline call cannot be timed out
        self._methods: dict[str, DispatchSpec] = registered_methods(worker_cls)
        self._closed = False
        role_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "EASYRL_ROLE": role, INLINE_ENV: "inline"}
        self._process = RoleProcess({**pool.env, **(env or {}), **role_env})
        with _call_lock, self._process:
            _init_process_group(pool.use_gpu)
            _live_groups.add(id(self))
            try:
                self._worker: Any = worker_cls(*_by_value(init_args), **_by_value(init_kwargs))
            except BaseException as exc:  # a signal during start-up too: leave no process group behind
                _live_groups.discard(id(self))
                _release_process_group()
                if isinstance(exc, Exception):
                    raise _worker_error(role, exc) from exc
                raise
        logger.info("started the %s worker (%s) in this process", role, worker_cls.__name__)

    # ----------------------------------------------------------------------------------------------- calling
    def _start(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float | None
    ) -> InlineCall:
        del timeout_s  # a call runs to its end inline (docs/distributed.md, "One process")
        if self._closed:
            raise RuntimeError(f"the {self.role} worker group is shut down")
        spec = self._methods.get(method)
        if spec is None:
            raise AttributeError(self._undeclared(method))
        if spec.dispatch in (Dispatch.DP_SPLIT, Dispatch.ENGINE_SPLIT):  # the same split as Ray's path, of one
            ((args, kwargs),) = split_grouped_args(1, 1, args, kwargs)
        with _stop_watch.watching(self.role, method), _call_lock, self._process:
            try:
                value = getattr(self._worker, method)(*_by_value(args), **_by_value(kwargs))
            except Exception as exc:  # a KeyboardInterrupt (Ctrl-C, a debugger's quit) goes through as it is
                return InlineCall(self, method, spec, None, _worker_error(self.role, exc))
            return InlineCall(self, method, spec, _by_value(value), None)

    def check_alive(self) -> None:
        """Nothing to check: the worker lives as long as this process."""

    def shutdown(self) -> None:
        """Drop the worker and free what it held (idempotent); the last inline group also ends the process group."""
        if self._closed:
            return
        self._closed = True
        self._worker = None
        _live_groups.discard(id(self))
        gc.collect()  # the model, optimizer and engine go now, not at the next collection
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        _release_process_group()
        logger.info("shut down the %s worker", self.role)

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "live"
        return f"InlineGroup(role={self.role!r}, cls={self.worker_cls.__name__}, {state})"
