"""Device memory of the processes that share a GPU with the rollout engine: hand back, measure, explain.

The actor, reference and critic workers of one GPU are separate processes, and the vLLM engine lives in the actor's.
PyTorch's caching allocator keeps the blocks a forward or backward pass used *reserved* after the tensors are gone:
invisible to `memory_allocated`, but not free for vLLM, which maps its KV cache again with its own allocator when it
wakes. So every process hands its cached blocks back (`release_cached_memory`) when a phase that the engine follows
ends: the actor right before each wake, the reference and critic after each of their passes.

`MemoryLedger` records, per role, the memory at the phase boundaries (after generate, after sleep, before wake) and
the peak of each phase (old, ref, values, update), logged every step as ``perf/mem/<role>/<name>_gb``:

- on CUDA, a boundary is the memory in use on the whole device (every process, the engine's pools included), and a
  peak is the most this process's allocator reserved during the phase, *less the engine's pool*: vLLM allocates its
  weights and KV cache from a ``torch.cuda.MemPool`` of the same caching allocator, and its sleep unmaps that memory
  behind the allocator's back, so ``max_memory_reserved`` counts the engine's ~utilization x device at every moment.
  `MemoryLedger.building_engine` measures that pool once (the allocator before vs after the engine is built), and
  every figure of this process's allocator is reported without it: ``perf/mem/actor/engine_gb`` is the engine's
  part, ``perf/device_total_gb`` the device (`torch.cuda.mem_get_info`);
- on CPU, a boundary is this process's resident memory (RSS), and a peak its peak RSS during the phase (Linux:
  `/proc/self/clear_refs`; elsewhere CPU peaks are not logged).

When a wake still does not fit, `MemoryLedger.wake` stops with one `EngineWakeError` that names what was measured
and the keys that make room, instead of the allocator's bare "out of memory".
"""

from __future__ import annotations

import functools
import gc
import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from easyrl.distributed.dispatch import Dispatch, register


GiB = 2**30
"""Bytes in a GiB. Its own constant, not the driver-only plan's (`easyrl.memory_plan`): a worker never imports the
driver's modules."""

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
BOUNDARIES = ("after_generate", "after_sleep", "before_wake")
"""Phase boundaries the actor's ledger marks, in the order of a step (before_wake opens the next generation)."""
PEAK_PHASES = {"actor": ("old", "update"), "ref": ("ref",), "critic": ("values", "update")}
"""The phases whose peak each role logs."""


@dataclass(frozen=True)
class MemoryLevers:
    """The settings that make room on a GPU, with their values in this run: a failed engine wake names them. No
    defaults: the values are always the run's (`easyrl.trainer.role_specs.memory_levers`)."""

    gpu_memory_utilization: float
    actor_offload_params: bool
    actor_offload_optimizer: bool
    ref_offload_params: bool
    actor_max_token_len_per_gpu: int


class EngineWakeError(RuntimeError):
    """The rollout engine could not take back its memory: the message says what was measured and what to change."""


def release_cached_memory(device: torch.device) -> None:
    """Collect garbage and give the allocator's cached blocks back to the device (CUDA only).

    On CPU there is nothing to hand back: freed tensors go straight back to the host allocator, and no engine maps
    memory of its own. A full `gc.collect()` there cost ~0.2 s a call with torch and transformers loaded (three calls
    a step took the demo from ~60 s to ~110 s), for nothing."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_keys(role: str) -> list[str]:
    """The ``perf/mem/<role>/*`` metrics a step logs for `role` (on CPU the peaks need Linux)."""
    names = [*(BOUNDARIES if role == "actor" else ()), *(f"peak_{p}" for p in PEAK_PHASES[role])]
    return [f"perf/mem/{role}/{name}_gb" for name in names]


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: torch's OutOfMemoryError, or vLLM's cumem allocator's RuntimeError
    ("CUDA Error: out of memory at .../cumem_allocator.cpp")."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def _gib(value: int | None) -> str:
    return "not measured" if value is None else f"{value / GiB:.2f} GiB"


def wake_error_message(
    tags: list[str] | None,
    free_bytes: int | None,
    total_bytes: int | None,
    slept_bytes: int | None,
    weights_bytes: int | None,
    held_bytes: int | None,
    levers: MemoryLevers,
    reason: str,
    engine_bytes: int = 0,
) -> str:
    """The one-paragraph explanation of a failed wake. `slept_bytes`: what the engine gave back when it last slept
    (weights + KV cache); `weights_bytes`: what waking its weights took (measured at an earlier weights wake);
    `held_bytes`: what this process's allocator still holds, of which `engine_bytes` are the engine's own pool (which
    the allocator counts as held also while the engine sleeps): the rest is the actor's training state."""
    if tags == ["weights"]:
        what = "weights"
        need = (
            f"its weights need {_gib(weights_bytes)}"
            if weights_bytes is not None
            else f"its weights are part of the {_gib(slept_bytes)} it gave back when it slept"
        )
    elif tags == ["kv_cache"]:
        what = "KV cache"
        kv = slept_bytes - weights_bytes if slept_bytes is not None and weights_bytes is not None else None
        need = (
            f"its KV cache needs about {_gib(kv)} (it gave back {_gib(slept_bytes)} when it slept, "
            f"of which its weights took {_gib(weights_bytes)} back)"
        )
    else:
        what = "weights and KV cache"
        need = f"its weights and KV cache need about {_gib(slept_bytes)} (what it gave back when it slept)"
    lv = levers
    if held_bytes is not None and engine_bytes:
        held = (
            f"the actor's training state held {_gib(max(0, held_bytes - engine_bytes))} (its allocator's "
            f"{_gib(held_bytes)} less the engine's own {_gib(engine_bytes)} pool)"
        )
    else:
        held = f"the actor's PyTorch allocator still held {_gib(held_bytes)}"
    return (
        f"the rollout engine could not wake its {what}: the GPU ran out of memory. Measured: {_gib(free_bytes)} "
        f"free of the device's {_gib(total_bytes)}; {need}; {held}, and the rest in use belongs to the engine's own pools and the other processes on this "
        f"GPU (reference, critic). Make room with a smaller KV cache "
        f"(worker.rollout.gpu_memory_utilization, now {lv.gpu_memory_utilization}), by keeping training state "
        f"off the GPU while generating (worker.actor.offload.offload_params / worker.actor.offload.offload_optimizer, "
        f"now {lv.actor_offload_params} / {lv.actor_offload_optimizer}; worker.ref.offload.offload_params, "
        f"now {lv.ref_offload_params}), or with smaller micro-batches "
        f"(worker.actor.max_token_len_per_gpu, now {lv.actor_max_token_len_per_gpu}). The allocator said: {reason}"
    )


class MemoryLedger:
    """One worker's memory at its phase boundaries and peaks (see the module docstring), and its engine's wakes."""

    def __init__(self, role: str, device: torch.device, levers: MemoryLevers | None = None) -> None:
        self.role = role
        self.device = device
        self.levers = levers
        """The settings a failed wake names; only the role that owns an engine (the actor) has them."""
        self.values: dict[str, float] = {}
        self.events: deque[str] = deque(maxlen=256)
        """The lifecycle of this process, oldest first: what ran in which order (releases, marks, sleeps, wakes)."""
        self.slept_bytes: int | None = None
        self.weights_bytes: int | None = None
        self.engine_reserved = 0
        """What building the rollout engine added to this process's allocator (reserved bytes: its pools)."""
        self.engine_allocated = 0
        """The same in allocated bytes (its weights, KV cache and other live tensors)."""
        self._earlier_peak = 0.0  # allocator peak before a phase reset the counters, for `memory_stats`

    # ------------------------------------------------------------------ measuring
    def _device_info(self) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else None

    def used_bytes(self) -> int:
        """Memory in use on the whole device (CUDA), or this process's RSS (CPU)."""
        info = self._device_info()
        if info is not None:
            return info[1] - info[0]
        import psutil

        return int(psutil.Process().memory_info().rss)

    def _record(self, name: str, value: int) -> None:
        """Keep the largest value of `name` since the last `drain` (a step may generate several times)."""
        self.values[name] = max(self.values.get(name, 0.0), value / GiB)

    def mark(self, boundary: str) -> None:
        """Record the memory in use at a phase boundary."""
        self.events.append(boundary)
        self._record(boundary, self.used_bytes())

    def release(self, why: str) -> None:
        """Hand the allocator's cached blocks back to the device."""
        self.events.append(f"release:{why}")
        release_cached_memory(self.device)

    @contextmanager
    def building_engine(self) -> Iterator[None]:
        """Measure what building the rollout engine inside the block takes from this process's allocator (CUDA): the
        engine's pools, subtracted from every later allocator figure of this process (module docstring)."""
        if self.device.type != "cuda":
            yield
            return
        release_cached_memory(self.device)
        reserved, allocated = torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device)
        yield
        release_cached_memory(self.device)  # what the engine's start-up profiling left cached is not the engine's
        self.engine_reserved = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        self.engine_allocated = max(0, torch.cuda.memory_allocated(self.device) - allocated)
        self.events.append(f"engine_built:{self.engine_reserved / GiB:.2f}GiB")

    @contextmanager
    def peak(self, phase: str) -> Iterator[None]:
        """Record the peak memory of the block as ``peak_<phase>``."""
        self.events.append(f"start:{phase}")
        if self.device.type == "cuda":
            self._earlier_peak = max(self._earlier_peak, self._training_peak_allocated() / GiB)
            torch.cuda.reset_peak_memory_stats(self.device)
        cpu_peak = self.device.type != "cuda" and _reset_cpu_peak()
        yield
        if self.device.type == "cuda":
            self._record(f"peak_{phase}", torch.cuda.max_memory_reserved(self.device) - self.engine_reserved)
        elif cpu_peak:
            self._record(f"peak_{phase}", _cpu_peak_bytes())
        self.events.append(f"end:{phase}")

    def drain(self) -> dict[str, float]:
        """The ``perf/mem/<role>/*`` metrics since the last call (then forgotten), and the engine's pool (CUDA, the
        role that owns an engine: every step, it does not change)."""
        out = {f"perf/mem/{self.role}/{name}_gb": value for name, value in self.values.items()}
        if self.engine_reserved:
            out[f"perf/mem/{self.role}/engine_gb"] = self.engine_reserved / GiB
        self.values = {}
        return out

    def _training_peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.engine_allocated

    def allocator_stats(self) -> dict[str, float]:
        """CUDA: the allocator's peak since the last call (then reset) and what it holds now, both without the
        engine's pool (training memory), what the whole device has in use now, and its total (GiB). Empty on CPU."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        peak = max(self._earlier_peak, self._training_peak_allocated() / GiB)
        stats = {
            "perf/max_memory_allocated_gb": peak,
            "perf/memory_allocated_gb": (torch.cuda.memory_allocated(self.device) - self.engine_allocated) / GiB,
            "perf/device_memory_used_gb": (total - free) / GiB,
            "perf/device_total_gb": total / GiB,
        }
        self._earlier_peak = 0.0
        torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    # ------------------------------------------------------------------ the engine's sleep and wake
    def sleep(self, engine: Any) -> None:
        """Put the engine to sleep, hand back the allocator's cache, and remember what the device got back."""
        before = self._device_info()
        self.events.append("sleep")
        engine.sleep()
        self.release("after_sleep")
        after = self._device_info()
        if before is not None and after is not None:
            self.slept_bytes = max(0, after[0] - before[0])
        self.mark("after_sleep")

    def wake(self, engine: Any, tags: list[str] | None = None) -> None:
        """Hand back the allocator's cache, then wake `tags` of the engine (all when None); a wake that does not fit
        raises `EngineWakeError` with what was measured."""
        self.release("before_wake")
        if tags is None or "kv_cache" in tags:
            self.mark("before_wake")
        before = self._device_info()
        self.events.append("wake" if tags is None else "wake:" + ",".join(tags))
        try:
            engine.wake_up(tags)
        except Exception as exc:  # vLLM's cumem allocator raises a plain RuntimeError
            if not is_out_of_memory(exc):
                raise
            info = self._device_info()
            held = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else None
            assert self.levers is not None, f"the {self.role} ledger has no engine to wake"
            message = wake_error_message(
                tags,
                info[0] if info else None,
                info[1] if info else None,
                self.slept_bytes,
                self.weights_bytes,
                held,
                self.levers,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                engine_bytes=self.engine_reserved,
            )
            raise EngineWakeError(message) from None  # the message carries the allocator's line
        after = self._device_info()
        if tags == ["weights"] and before is not None and after is not None:
            self.weights_bytes = max(0, before[0] - after[0])


def _reset_cpu_peak() -> bool:
    """Reset this process's peak RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory(phase: str, release: bool = False) -> Callable[[F], F]:
    """Worker-method decorator: record the method's peak memory as ``peak_<phase>`` in ``self.ledger``; with
    `release`, hand the allocator's cache back afterwards (roles whose pass is followed by another process's)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            ledger: MemoryLedger = self.ledger
            try:
                with ledger.peak(phase):
                    return fn(self, *args, **kwargs)
            finally:
                if release:
                    ledger.release(f"after_{phase}")

        return wrapper  # type: ignore[return-value]

    return decorate


class MemoryReporting:
    """Mixin of the worker roles: ``memory_stats`` for the driver's per-step metrics, ``memory_events`` for tests."""

    ledger: MemoryLedger

    @register(dispatch=Dispatch.ALL)
    def memory_stats(self) -> dict[str, float]:
        """This worker's allocator figures (CUDA) and its ``perf/mem/<role>/*`` ledger since the last call."""
        return self.ledger.allocator_stats() | self.ledger.drain()

    @register(dispatch=Dispatch.ALL)
    def memory_events(self) -> list[str]:
        """The recent lifecycle events of this worker, oldest first."""
        return list(self.ledger.events)
