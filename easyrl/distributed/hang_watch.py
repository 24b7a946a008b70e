"""Frozen workers: a heartbeat from every worker process, and every rank's Python stack when one stops beating.

Why a heartbeat: the liveness pings (`easyrl.distributed.liveness`) queue behind the method an actor runs, so they
tell a dead actor from a live one, never a frozen one from a busy one. A process stopped by SIGSTOP, or whose main
thread holds the GIL inside a call that never returns, stays "alive" to Ray for ever, and the driver waited on it
until `trainer.worker_timeout_s` (an hour by default), deaf to a SIGTERM.

Worker side, :func:`arm` (run in each actor through Ray's ``__ray_call__`` once its ``__init__`` has run):

* a daemon thread puts a counter into Ray's GCS key-value store every :data:`HEARTBEAT_S`. It needs the process to
  run and the GIL to be released now and then: a stopped process (SIGSTOP; a device or file system hang that stops
  the process looks the same to the driver) or a main thread stuck holding the GIL stops it. A thread blocked in the
  kernel that released the GIL leaves the others beating: that hang is bounded by the call's own deadline.
* ``faulthandler`` is registered on :data:`STACK_SIGNAL` to write every thread's Python stack to the rank's stack
  file. Its handler is C code, so it answers even while a thread holds the GIL; a stopped process cannot answer (the
  signal waits until it is continued), which the report says.

Driver side, :class:`HangWatch` (one per worker group, read by every wait of `liveness.wait_for_results`): a rank
whose counter has not moved for ``detect_s`` while the driver waits is frozen; :func:`dump_stacks` then signals
every rank of every live group, gathers what each wrote (and the driver's own stack) into one report in the run
folder, and the wait raises :class:`~easyrl.distributed.errors.WorkerFrozenError` naming the call, the role and the
rank. Counting only while the driver waits matters: a driver paused itself (a laptop asleep) would otherwise find
every counter old at once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any


__all__ = ["HEARTBEAT_S", "STACK_SIGNAL", "HangWatch", "Rank", "arm", "detect_after", "dump_stacks"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""How often a worker's heartbeat thread beats."""

STACK_SIGNAL = signal.SIGUSR2
"""The signal on which a worker writes every thread's stack (neither Ray, torch nor vLLM uses it)."""

_NAMESPACE = b"easyrl_heartbeat"
_DUMP_WAIT_S = 2.0  # how long the ranks get to write their stacks
_GAP_S = 5.0  # two reads further apart than this: the driver did not watch in between, start counting afresh
_REPORT_BUDGET_S = 5.0  # detection + dump + error must fit the configured bound

# The worker's open stack file: kept referenced, faulthandler writes to its descriptor.
_stack_file: IO[str] | None = None


def detect_after(timeout_s: float) -> float:
    """Seconds without a beat after which a rank is frozen, so that the error (stacks gathered) comes within
    `timeout_s` of the last beat."""
    return max(timeout_s - _REPORT_BUDGET_S, timeout_s / 2)


# --------------------------------------------------------------------------------------------- worker side
def arm(instance: Any, key: str, stack_path: str) -> tuple[int, str]:
    """In a worker (through ``actor.__ray_call__``): start the heartbeat under `key` and write this process's
    stacks to `stack_path` on :data:`STACK_SIGNAL`. Returns (pid, node id)."""
    del instance  # __ray_call__ hands the actor instance first; the process is what is armed
    global _stack_file
    import ray
    from ray.experimental import internal_kv

    os.makedirs(os.path.dirname(stack_path) or ".", exist_ok=True)
    if _stack_file is not None:
        _stack_file.close()
    _stack_file = open(stack_path, "w", encoding="utf-8")  # noqa: SIM115  (open for the process's life)
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                internal_kv._internal_kv_put(key, str(count), overwrite=True, namespace=_NAMESPACE)
            except Exception:  # a GCS hiccup: the next beat retries; a missed beat is not a freeze yet
                logger.debug("heartbeat put failed", exc_info=True)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="easyrl-heartbeat", daemon=True).start()
    return os.getpid(), ray.get_runtime_context().get_node_id()


# --------------------------------------------------------------------------------------------- driver side
@dataclass
class Rank:
    """What the driver knows of one armed rank."""

    key: str
    pid: int
    node_id: str
    stack_path: str
    beats: bytes | None = None
    moved_at: float = field(default_factory=time.monotonic)


class HangWatch:
    """The heartbeats of one group's ranks, as the driver last read them."""

    def __init__(self, role: str, ranks: list[Rank], timeout_s: float) -> None:
        self.role = role
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.detect_s = detect_after(timeout_s)
        self._read_at = 0.0
        self._lock = threading.Lock()

    def frozen(self, skip: set[int]) -> tuple[int, float] | None:
        """(rank, seconds without a beat) of the first rank not in `skip` that stopped beating, at most one GCS read
        a heartbeat period; None while every rank beats."""
        from ray.experimental import internal_kv

        now = time.monotonic()
        with self._lock:
            if now - self._read_at < HEARTBEAT_S:
                return self._worst(now, skip)
            try:
                client = internal_kv.internal_kv_get_gcs_client()
                values = client.internal_kv_multi_get([r.key.encode() for r in self.ranks], _NAMESPACE, timeout=5)
            except Exception:  # the GCS itself is slow or gone: no verdict on the workers this tick
                logger.debug("reading the %s heartbeats failed", self.role, exc_info=True)
                return None
            gap = now - self._read_at > _GAP_S
            self._read_at = now
            for rank in self.ranks:
                value = values.get(rank.key.encode())
                # A new beat, or a driver that was not watching: count from now.
                if value != rank.beats or gap:
                    rank.beats, rank.moved_at = value, now
            return self._worst(now, skip)

    def _worst(self, now: float, skip: set[int]) -> tuple[int, float] | None:
        silent = [(now - r.moved_at, i) for i, r in enumerate(self.ranks) if i not in skip]
        if not silent:
            return None
        seconds, index = max(silent)
        return (index, seconds) if seconds >= self.detect_s else None


def _process_state(pid: int) -> str:
    """The state of local process `pid` in words (psutil's), or '' if unknown."""
    try:
        import psutil

        return str(psutil.Process(pid).status())
    except Exception:  # gone, or psutil missing: the report simply leaves the state out
        return ""


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            handle.seek(offset)
            return handle.read(1 << 20)  # a stack is a few KB; never a huge read
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _signal_and_collect(pid: int, path: str, wait_s: float) -> tuple[str, str]:
    """Signal `pid` to write its stacks to `path`, wait up to `wait_s` for them; (process state, new text)."""
    offset = _size(path)
    with contextlib.suppress(OSError):  # already gone: reported as no stack
        os.kill(pid, STACK_SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _size(path) == offset:
        time.sleep(0.05)
    time.sleep(0.1)  # the dump of many threads is written in pieces
    return _process_state(pid), _read_from(path, offset)


def _collect(targets: list[tuple[str, int, Rank]]) -> list[tuple[str, str]]:
    """(state, stack text) of every target: on this node by signal and file, on other nodes by a zero-CPU task
    pinned to the rank's node (which does the same there), all within about one :data:`_DUMP_WAIT_S`."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    out: list[tuple[str, str]] = [("", "")] * len(targets)
    remote: dict[int, Any] = {}
    local: list[tuple[int, int]] = []
    for index, (_, _, rank) in enumerate(targets):
        if rank.node_id and rank.node_id != here:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            task = ray.remote(num_cpus=0)(_signal_and_collect)
            strategy = NodeAffinitySchedulingStrategy(node_id=rank.node_id, soft=False)
            remote[index] = task.options(scheduling_strategy=strategy).remote(rank.pid, rank.stack_path, _DUMP_WAIT_S)
        else:
            local.append((index, _size(rank.stack_path)))
            with contextlib.suppress(OSError):
                os.kill(rank.pid, STACK_SIGNAL)
    deadline = time.monotonic() + _DUMP_WAIT_S
    while local and time.monotonic() < deadline:
        if all(_size(targets[i][2].stack_path) > offset for i, offset in local):
            break
        time.sleep(0.05)
    time.sleep(0.1)
    for index, offset in local:
        rank = targets[index][2]
        out[index] = (_process_state(rank.pid), _read_from(rank.stack_path, offset))
    for index, ref in remote.items():
        try:
            out[index] = ray.get(ref, timeout=_DUMP_WAIT_S + 10)
        except Exception as exc:  # the node is unreachable: say so in the report
            out[index] = ("", f"(could not reach its node: {type(exc).__name__})")
    return out


def dump_stacks(targets: list[tuple[str, int, Rank]], out_dir: str, reason: str) -> str:
    """Write every target's Python stack (role, rank, armed rank) and the driver's to a new report in `out_dir`;
    returns its path. A rank that does not answer within :data:`_DUMP_WAIT_S` is named with its state."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = os.path.join(out_dir, f"hang-{stamp}-{os.getpid()}.txt")
    collected = _collect(targets)
    with open(path, "w", encoding="utf-8") as report:
        report.write(f"{reason}\n\n== driver (pid {os.getpid()}) ==\n")
        report.flush()
        faulthandler.dump_traceback(file=report, all_threads=True)
        for (role, index, rank), (state, text) in zip(targets, collected, strict=True):
            where = f"pid {rank.pid}" + (f", {state}" if state else "")
            report.write(f"\n== {role} rank {index} ({where}) ==\n")
            if text.strip():
                report.write(text)
            else:
                why = "it is stopped (SIGSTOP)" if state == "stopped" else "it is stopped or stuck in the kernel"
                report.write(f"(no stack: it did not answer {STACK_SIGNAL.name} within {_DUMP_WAIT_S:g} s; {why})\n")
    return path
