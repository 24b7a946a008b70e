"""Fault injection on real Ray workers with real gloo process groups: no fault leaves the driver waiting silently.

Each test injects one fault while the driver waits on a worker call and measures the time to the error (logged as
`FAULT <name>: <s> s`, the figures of docs/benchmarks.md "Fault injection"). The bound is small here
(`hang_timeout_s=HANG_S`) to keep the suite quick; a run's default is `trainer.hang_timeout_s` = 120 s.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from easyrl.distributed import (
    Dispatch,
    ResourcePool,
    WorkerCallInterrupted,
    WorkerDiedError,
    WorkerFrozenError,
    WorkerGroup,
    init_distributed,
    init_ray,
    liveness,
    register,
)
from easyrl.signals import clear_stop_request, install_stop_handlers


logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
HANG_S = float(os.environ.get("EASYRL_FAULT_HANG_S", "4"))  # 120 measures the default bound (docs/benchmarks.md)


class FaultWorker:
    """A CPU rank; in its own gloo world with `gloo` (torch is imported only then: the other groups start faster)."""

    def __init__(self, gloo: bool = False) -> None:
        self.rank = int(os.environ["RANK"])
        if gloo:
            import torch

            torch.set_num_threads(1)
            init_distributed(timeout_s=120)

    @register(dispatch=Dispatch.ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch=Dispatch.ALL)
    def sleep_in_step(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch=Dispatch.ALL)
    def reduce_after(self, stall_rank: int, stall_s: float) -> float:
        """`stall_rank` sleeps first, so the other ranks wait for it inside the collective."""
        import torch
        import torch.distributed as dist

        if self.rank == stall_rank:
            time.sleep(stall_s)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor.item())


@pytest.fixture(scope="module")
def pool() -> Iterator[ResourcePool]:
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    started = init_ray(num_cpus=2, env_vars={"PYTHONPATH": pythonpath})
    pool = ResourcePool(1, 2, use_gpu=False)
    yield pool
    pool.remove()
    if started:
        ray.shutdown()


def _group(pool: ResourcePool, role: str, stack_dir: Path, gloo: bool = False) -> WorkerGroup:
    return WorkerGroup(
        FaultWorker, pool, role, gloo, num_cpus_per_worker=0.25, hang_timeout_s=HANG_S, stack_dir=str(stack_dir)
    )


def _measured(name: str, start: float) -> float:
    elapsed = time.monotonic() - start
    logger.warning("FAULT %s: %.2f s to the error", name, elapsed)
    return elapsed


def test_the_default_bound_leaves_room_for_the_stack_dump() -> None:
    """At the default 120 s the last heartbeat's silence is declared after 115 s, the wait's tick (1 s) and the dump
    (2 s while a rank cannot answer) come on top: the error lands before 120 s."""
    from easyrl.config import EasyRLConfig
    from easyrl.distributed import hang_watch

    default = EasyRLConfig().trainer.hang_timeout_s
    assert default == 120.0
    assert hang_watch.detect_after(default) + hang_watch.HEARTBEAT_S + hang_watch._DUMP_WAIT_S + 0.5 < default


def test_frozen_rank_is_named_with_every_stack_within_the_bound(pool: ResourcePool, tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP) while both ranks run a long call: the wait ends with one line naming the call,
    role and rank, within the bound, and the report holds rank 0's stack and says rank 1 could not answer."""
    group = _group(pool, "actor", tmp_path)
    pids = group.pid()
    try:
        call = group.call_async("sleep_in_step", 300.0)
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(WorkerFrozenError) as info:
            call.result()
        elapsed = _measured("frozen rank (SIGSTOP)", start)
        assert elapsed < HANG_S + 1.5, f"took {elapsed:.1f} s"
        err = info.value
        assert (err.role, err.rank, err.method) == ("actor", 1, "sleep_in_step")
        assert "\n" not in str(err) and "the actor worker of rank 1 is frozen" in str(err)
        report = Path(err.stacks).read_text()
        assert report.startswith("the actor worker of rank 1 sent no heartbeat")
        assert "== driver" in report and "test_frozen_rank_is_named" in report  # the driver's own stack
        rank0 = report.split("== actor rank 0")[1].split("== actor rank 1")[0]
        assert "sleep_in_step" in rank0, report
        assert f"== actor rank 1 (pid {pids[1]}, stopped) ==\n(no stack: it did not answer SIGUSR2" in report
        assert Path(err.stacks).parent == tmp_path
    finally:
        os.kill(pids[1], signal.SIGCONT)
        group.shutdown()


def test_busy_rank_that_still_beats_is_not_frozen(pool: ResourcePool, tmp_path: Path) -> None:
    """A call longer than the bound, on ranks that run normally, is waited for: only a silent heartbeat is a freeze."""
    group = _group(pool, "ref", tmp_path)
    try:
        assert group.sleep_in_step(HANG_S + 2) == [0, 1]
        assert not list(tmp_path.glob("hang-*.txt"))
    finally:
        group.shutdown()


def test_frozen_idle_rank_of_another_group_ends_the_wait(pool: ResourcePool, tmp_path: Path) -> None:
    """The frozen rank belongs to a group the driver is not waiting on (an idle critic while the actor trains)."""
    actor = _group(pool, "actor", tmp_path)
    critic = _group(pool, "critic", tmp_path)
    critic_pid = critic.pid()[0]
    try:
        start = time.monotonic()
        os.kill(critic_pid, signal.SIGSTOP)
        with pytest.raises(
            WorkerFrozenError, match=r"the critic worker of rank 0 is frozen .* on 'sleep_in_step' of the actor"
        ):
            actor.sleep_in_step(300.0)
        assert _measured("frozen idle rank of another group", start) < HANG_S + 1.5
    finally:
        os.kill(critic_pid, signal.SIGCONT)
        critic.shutdown()
        actor.shutdown()


def test_killed_worker_is_named_at_once(pool: ResourcePool, tmp_path: Path) -> None:
    """A worker process killed (an engine or trainer rank gone: OOM killer, kill -9) while the driver waits."""
    group = _group(pool, "rollout", tmp_path)
    pid = group.pid()[1]
    try:
        call = group.call_async("sleep_in_step", 300.0)
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="the rollout worker of rank 1 died"):
            call.result()
        assert _measured("killed worker (SIGKILL)", start) < 5
    finally:
        group.shutdown()


def test_peer_dropped_mid_collective_is_named(pool: ResourcePool, tmp_path: Path) -> None:
    """Rank 0 waits in a gloo all-reduce for rank 1, which is killed: the death is reported, not the collective's
    timeout (gloo's is minutes)."""
    group = _group(pool, "learner", tmp_path, gloo=True)
    pid = group.pid()[1]
    try:
        call = group.call_async("reduce_after", 1, 300.0)
        time.sleep(1.0)
        assert not call.done()
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="the learner worker of rank 1 died"):
            call.result()
        assert _measured("peer dropped mid-collective (SIGKILL)", start) < 5
    finally:
        group.shutdown()


def test_sigterm_while_waiting_on_a_call_that_never_ends(pool: ResourcePool, tmp_path: Path) -> None:
    """The driver waits on a call that will not end; SIGTERM gives it the stop's grace, then the wait gives up with
    one line naming the signal and the call (the run then stops without saving: the workers are still in it)."""
    group = _group(pool, "actor", tmp_path)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    asked: list[str] = []
    try:
        install_stop_handlers(asked.append, lambda: bool(asked), wait_grace_s=1.0)
        call = group.call_async("sleep_in_step", 300.0)
        start = time.monotonic()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(
            WorkerCallInterrupted,
            match="SIGTERM: the call of 'sleep_in_step' on the actor workers did not end within 1 s",
        ):
            call.result()
        assert _measured("SIGTERM while waiting on a worker call", start) < 3.5
        assert asked == ["SIGTERM"]
        # A wait on a call started after the stop (the save's) is not given up by the grace.
        liveness._check_stop(time.monotonic(), "actor", "save_checkpoint")
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        clear_stop_request()
        group.shutdown()
