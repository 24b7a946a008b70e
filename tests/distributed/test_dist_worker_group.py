"""Worker groups on a real local Ray instance with real gloo process groups: dispatch, sharing, failures."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from easyrl.distributed import (
    Dispatch,
    ResourcePool,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerGroupError,
    WorkerTimeoutError,
    init_distributed,
    init_ray,
    register,
)


logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent


@dataclass
class TinyBatch:
    """A batch of integers, split and concatenated along its only dimension."""

    values: list[int]

    def __len__(self) -> int:
        return len(self.values)

    def chunk(self, n: int) -> list[TinyBatch]:
        size = len(self.values) // n
        return [TinyBatch(self.values[i * size : (i + 1) * size]) for i in range(n)]

    @classmethod
    def concat(cls, parts: list[TinyBatch]) -> TinyBatch:
        return cls([v for part in parts for v in part.values])


class ToyWorker:
    """A CPU worker in its own gloo world (torch is imported lazily: the workers of BrokenWorker start faster)."""

    def __init__(self, offset: int = 0) -> None:
        import torch

        torch.set_num_threads(1)
        self.info = init_distributed(timeout_s=120)
        self.offset = offset

    @register(dispatch=Dispatch.ALL)
    def identity(self) -> dict[str, str | int]:
        import torch.distributed as dist

        return {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "local_rank": self.info.local_rank,
            "role": os.environ["EASYRL_ROLE"],
            "port": os.environ["MASTER_PORT"],
            "omp": os.environ.get("OMP_NUM_THREADS", ""),
        }

    @register(dispatch=Dispatch.RANK0)
    def rank_tagged(self, x: int) -> int:
        return 100 * self.info.rank + x

    @register(dispatch=Dispatch.DP_SPLIT)
    def tag(self, batch: TinyBatch, scale: int = 1) -> TinyBatch:
        return TinyBatch([1000 * self.info.rank + scale * v + self.offset for v in batch.values])

    @register(dispatch=Dispatch.DP_SPLIT)
    def stats(self, batch: TinyBatch) -> dict[str, float]:
        return {"mean": sum(batch.values) / len(batch), "rank": float(self.info.rank)}

    @register(dispatch=Dispatch.ALL)
    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(self.info.rank + 1)])
        dist.all_reduce(tensor)
        return float(tensor.item())

    @register(dispatch=Dispatch.ALL)
    def fail_on(self, rank: int) -> None:
        if self.info.rank == rank:
            raise ValueError(f"bad value on rank {rank}")

    @register(dispatch=Dispatch.ALL)
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(dispatch=Dispatch.ALL)
    def reduce_after(self, stall_rank: int, stall_s: float) -> float:
        """``stall_rank`` sleeps first, so the other ranks wait for it inside the collective."""
        import torch
        import torch.distributed as dist

        if self.info.rank == stall_rank:
            time.sleep(stall_s)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor.item())

    @register(dispatch=Dispatch.ALL)
    def raise_then_reduce(self, raise_rank: int) -> float:
        """``raise_rank`` raises before the collective, which the other ranks then wait in for good."""
        import torch
        import torch.distributed as dist

        if self.info.rank == raise_rank:
            raise FloatingPointError(f"non-finite shard on rank {raise_rank}")
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor.item())

    @register(dispatch=Dispatch.ALL)
    def exit_then_reduce(self, exit_rank: int) -> float:
        import torch
        import torch.distributed as dist

        if self.info.rank == exit_rank:
            time.sleep(0.5)
            os._exit(1)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def undeclared(self) -> int:
        return 1


class BrokenWorker:
    def __init__(self) -> None:
        raise RuntimeError("cannot load the model")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    started = init_ray(num_cpus=4, env_vars={"PYTHONPATH": pythonpath})
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster: None) -> Iterator[ResourcePool]:
    pool = ResourcePool(1, 2, use_gpu=False)
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def toy(pool: ResourcePool) -> Iterator[WorkerGroup]:
    group = WorkerGroup(ToyWorker, pool, "actor", num_cpus_per_worker=0.25, offset=0)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def critic(pool: ResourcePool) -> Iterator[WorkerGroup]:
    """A second group on the same bundles (the last test kills one of its workers)."""
    group = WorkerGroup(ToyWorker, pool, "critic", num_cpus_per_worker=0.25, offset=5)
    yield group
    group.shutdown()


def test_all_gives_every_rank_its_environment(toy: WorkerGroup) -> None:
    infos = toy.identity()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert {i["role"] for i in infos} == {"actor"}
    assert {i["port"] for i in infos} == {str(toy.master_port)}
    assert {i["omp"] for i in infos} == {"1"}  # init_ray's worker env reaches the actors


def test_rank0_returns_rank0_result(toy: WorkerGroup) -> None:
    assert toy.rank_tagged(7) == 7


class OtherWorker:
    """Another role with a method of the same name."""

    @register(dispatch=Dispatch.RANK0)
    def rank_tagged(self, x: int) -> int:
        return x


def test_submit_starts_the_worker_classes_own_method_only(toy: WorkerGroup) -> None:
    """`submit` takes the method itself (typed for mypy) and runs it as `call_async` by its name would; another
    class's method of the same name is refused before anything runs."""
    assert toy.submit(ToyWorker.rank_tagged, 7).result() == 7
    with pytest.raises(AttributeError, match="is not a method of ToyWorker"):
        toy.submit(OtherWorker.rank_tagged, 7)


def test_dp_split_concatenates_in_rank_order(toy: WorkerGroup) -> None:
    out = toy.tag(TinyBatch([0, 1, 2, 3, 4, 5]), scale=2)
    assert out == TinyBatch([0, 2, 4, 1006, 1008, 1010])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        toy.tag(TinyBatch([1, 2, 3]))


def test_dp_split_merges_metrics_by_mean(toy: WorkerGroup) -> None:
    # rank 0 sees [0, 2] (mean 1), rank 1 sees [4, 10] (mean 7)
    assert toy.stats(TinyBatch([0, 2, 4, 10])) == {"mean": 4.0, "rank": 0.5}


def test_real_gloo_all_reduce(toy: WorkerGroup) -> None:
    assert toy.all_reduce_rank() == [3.0, 3.0]
    assert toy.call("all_reduce_rank", timeout_s=30) == [3.0, 3.0]


def test_undeclared_methods_are_not_callable(toy: WorkerGroup) -> None:
    with pytest.raises(AttributeError, match="not declared with @register"):
        toy.undeclared()
    with pytest.raises(AttributeError, match="no method 'missing'"):
        toy.call_async("missing")


def test_two_groups_share_a_pool_with_their_own_worlds(toy: WorkerGroup, critic: WorkerGroup) -> None:
    assert critic.master_port != toy.master_port
    # overlap the two groups: both collectives run at once, each in its own world
    first, second = toy.call_async("all_reduce_rank"), critic.call_async("all_reduce_rank")
    assert second.result() == [3.0, 3.0]
    assert first.result() == [3.0, 3.0]
    assert first.done() and second.done()
    assert critic.tag(TinyBatch([1, 2])) == TinyBatch([6, 1007])
    assert {i["role"] for i in critic.identity()} == {"critic"}


def test_method_error_names_role_rank_and_message(toy: WorkerGroup, caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level("ERROR", logger="easyrl.distributed.liveness"),
        pytest.raises(WorkerError, match="the actor worker of rank 1") as info,
    ):
        toy.fail_on(1)
    assert info.value.rank == 1 and info.value.role == "actor"
    assert "ValueError: bad value on rank 1" in str(info.value)
    # logged on the driver the moment it arrived, remote traceback and all (before anything that could hang)
    (logged,) = [r.getMessage() for r in caplog.records if "fail_on failed on rank 1" in r.getMessage()]
    assert ", in fail_on" in logged and "ValueError: bad value on rank 1" in logged
    assert toy.rank_tagged(1) == 1  # the group is still usable after a plain exception


def test_constructor_error_is_reported(pool: ResourcePool) -> None:
    with pytest.raises(WorkerError, match="cannot load the model") as info:
        WorkerGroup(BrokenWorker, pool, "reward", num_cpus_per_worker=0.25)
    assert info.value.role == "reward"


def test_per_call_timeout(toy: WorkerGroup) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"'sleep' on the actor workers timed out after 1\.5 s"):
        toy.call("sleep", 4, timeout_s=1.5)
    assert time.monotonic() - start < 4
    toy.sleep(0)  # the group is still usable once the slow call ends


def test_killed_rank_while_peer_waits_in_collective(pool: ResourcePool) -> None:
    group = WorkerGroup(ToyWorker, pool, "victim", num_cpus_per_worker=0.25)
    try:
        handle = group.call_async("reduce_after", 1, 300.0)  # rank 0 blocks in all_reduce waiting for rank 1
        time.sleep(1.0)
        assert not handle.done()
        start = time.monotonic()
        ray.kill(group._actors[1])
        with pytest.raises(WorkerDiedError, match="the victim worker of rank 1 died") as info:
            handle.result()
        elapsed = time.monotonic() - start
        logger.info("death detected in %.2f s", elapsed)
        assert elapsed < 60
        assert info.value.role == "victim" and info.value.rank == 1
        with pytest.raises(WorkerDiedError):  # the group stays broken
            group.identity()
    finally:
        group.shutdown()


def test_raising_rank_stops_the_peer_waiting_in_collective(pool: ResourcePool) -> None:
    """Rank 1 raises while rank 0 waits for it in an all-reduce (gloo's timeout here: 120 s): the driver reports
    rank 1's error at once and stops rank 0 rather than leaving it in the collective."""
    group = WorkerGroup(ToyWorker, pool, "learner", num_cpus_per_worker=0.25)
    try:
        rank0 = group._actors[0]
        start = time.monotonic()
        with pytest.raises(WorkerError, match="the learner worker of rank 1 raised") as info:
            group.raise_then_reduce(1)
        elapsed = time.monotonic() - start
        logger.info("error surfaced in %.2f s", elapsed)
        assert elapsed < 60, f"took {elapsed:.1f} s"
        assert info.value.rank == 1 and info.value.role == "learner"
        assert "FloatingPointError: non-finite shard on rank 1" in str(info.value)
        assert "rank(s) [0] were still running 'raise_then_reduce'" in str(info.value)
        with pytest.raises(ray.exceptions.RayActorError):  # rank 0 no longer waits in the collective
            ray.get(rank0.__ray_ready__.remote(), timeout=30)
        with pytest.raises(RuntimeError, match="the learner worker group is shut down"):
            group.identity()
    finally:
        group.shutdown()


def test_exit_in_another_group_interrupts_the_wait(toy: WorkerGroup, critic: WorkerGroup) -> None:
    """Critic rank 1 exits while critic rank 0 waits for it in a collective and the driver waits on the actor."""
    pending = critic.call_async("exit_then_reduce", 1)  # not waited on by the driver
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="the critic worker of rank 1 died") as info:
        toy.sleep(4)
    elapsed = time.monotonic() - start
    logger.info("death in another group detected in %.2f s", elapsed)
    assert elapsed < 4
    assert info.value.role == "critic"
    critic.shutdown()
    with pytest.raises(WorkerGroupError):
        pending.result()
    toy.sleep(0)  # a shut-down group no longer fails the others


def test_pool_too_large_fails_fast_with_a_hint(ray_cluster: None) -> None:
    with pytest.raises(ResourceUnavailableError, match="asked for 8 GPUs, the Ray cluster has 0: set trainer"):
        ResourcePool(1, 8, use_gpu=True)
    with pytest.raises(ResourceUnavailableError, match="asked for 64 CPUs"):
        ResourcePool(2, 32, use_gpu=False)
