"""The inline backend's group (`easyrl.distributed.inline`): a worker built in this process answers as a one-rank Ray
group does, with a process of its own swapped in around each call (environment, generators, threads), arguments and
results by value, and a method's exception raised as the `WorkerError` naming the role."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

from easyrl import signals
from easyrl.distributed import Dispatch, WorkerCallInterrupted, WorkerError, register
from easyrl.distributed.inline import InlineGroup, InlinePool


@dataclass
class Rows:
    values: list[int]

    def chunk(self, n: int) -> list[Rows]:
        size = len(self.values) // n
        return [Rows(self.values[i * size : (i + 1) * size]) for i in range(n)]

    @classmethod
    def concat(cls, parts: list[Rows]) -> Rows:
        return cls([v for part in parts for v in part.values])


class SeededWorker:
    """Seeds its generators in `__init__` as every role does (`setup_process`), then draws from them."""

    def __init__(self, seed: int, threads: int = 3) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        self.kept: list[int] = []

    @register(dispatch=Dispatch.ALL)
    def draws(self) -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    @register(dispatch=Dispatch.RANK0)
    def identity(self) -> dict[str, object]:
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "role": os.environ["EASYRL_ROLE"],
            "threads": torch.get_num_threads(),
            "tokenizers": os.environ.get("TOKENIZERS_PARALLELISM"),
        }

    @register(dispatch=Dispatch.DP_SPLIT)
    def double_in_place(self, rows: Rows) -> Rows:
        for i in range(len(rows.values)):  # writes into the rows it was given
            rows.values[i] *= 2
        self.kept = rows.values
        return rows

    @register(dispatch=Dispatch.RANK0)
    def scale_in_place(self, scores: torch.Tensor, probe: object) -> dict[str, object]:
        scores.mul_(2)  # writes into the tensor it was given
        return {"scaled": scores, "threads": torch.get_num_threads()}

    @register(dispatch=Dispatch.RANK0)
    def kept_rows(self) -> list[int]:
        return self.kept

    @register(dispatch=Dispatch.ALL)
    def fail(self) -> None:
        raise ValueError("the loss went NaN")

    def undeclared(self) -> None: ...


class BrokenWorker:
    def __init__(self) -> None:
        raise FileNotFoundError("no model at /nowhere")


@pytest.fixture
def pool() -> InlinePool:
    return InlinePool(use_gpu=False, env={"EASYRL_TEST_ENGINE_VAR": "1"})


def test_a_role_draws_as_a_process_of_its_own_would(pool: InlinePool) -> None:
    """Two roles and the driver each draw from their own generators: interleaving their calls changes nothing."""
    random.seed(7)
    driver_alone = [random.random() for _ in range(3)]
    random.seed(7)
    a = InlineGroup(SeededWorker, pool, "actor", 1)
    b = InlineGroup(SeededWorker, pool, "ref", 1)
    try:
        driver = [random.random()]
        first_a = a.draws()
        driver.append(random.random())
        first_b, second_b = b.draws(), b.draws()
        second_a = a.draws()
        driver.append(random.random())
    finally:
        a.shutdown()
        b.shutdown()
    assert driver == driver_alone  # the workers' seeding and draws never touched the driver's generators
    assert first_a == first_b and second_a == second_b  # one seed, one sequence, whatever the interleaving
    assert first_a != second_a


def test_a_role_has_its_environment_and_threads_and_the_driver_keeps_its_own(pool: InlinePool) -> None:
    threads = torch.get_num_threads()
    os.environ.pop("EASYRL_ROLE", None)
    group = InlineGroup(SeededWorker, pool, "critic", 1, threads=2)
    try:
        assert group.identity() == {"rank": 0, "world": 1, "role": "critic", "threads": 2, "tokenizers": "false"}
        assert group.call_async("identity").done()
        assert group.methods["double_in_place"] is Dispatch.DP_SPLIT
    finally:
        group.shutdown()
    assert "EASYRL_ROLE" not in os.environ and "EASYRL_TEST_ENGINE_VAR" not in os.environ
    assert torch.get_num_threads() == threads
    assert not dist.is_initialized()  # the last inline group ended the process group it made


def test_arguments_and_results_go_by_value(pool: InlinePool) -> None:
    """As over Ray: a worker writing into its argument, or the driver into a result, changes nothing on the other
    side."""
    group = InlineGroup(SeededWorker, pool, "actor", 1)
    try:
        rows = Rows([1, 2, 3, 4])
        out = group.double_in_place(rows)
        assert rows.values == [1, 2, 3, 4] and out.values == [2, 4, 6, 8]
        out.values[0] = -1
        assert group.kept_rows() == [2, 4, 6, 8]
    finally:
        group.shutdown()


class ThreadProbe:
    """Records the torch thread count its deepcopy ran at (the inline group copies arguments and results)."""

    def __init__(self) -> None:
        self.copied_at: list[int] = []

    def __deepcopy__(self, memo: dict[int, object]) -> ThreadProbe:
        self.copied_at.append(torch.get_num_threads())
        return self


def test_tensors_go_by_value_copied_at_one_thread_and_the_call_keeps_its_threads(pool: InlinePool) -> None:
    """A batch's copy runs at one torch thread (waking the pool for each tensor's copy cost 50x the copy); the
    method itself computes at the role's threads and the driver gets its own back."""
    threads = torch.get_num_threads()
    group = InlineGroup(SeededWorker, pool, "actor", 1, threads=2)
    try:
        probe = ThreadProbe()
        scores = torch.arange(6.0).reshape(2, 3)
        out = group.scale_in_place(scores, probe)
        assert probe.copied_at == [1]  # the argument's copy; the result is copied too (the same function)
        assert torch.equal(scores, torch.arange(6.0).reshape(2, 3))  # the worker wrote into its own copy
        assert torch.equal(out["scaled"], torch.arange(6.0).reshape(2, 3) * 2) and out["threads"] == 2
    finally:
        group.shutdown()
    assert torch.get_num_threads() == threads


def test_a_method_error_names_the_role_when_its_result_is_read(pool: InlinePool) -> None:
    group = InlineGroup(SeededWorker, pool, "actor", 1)
    try:
        call = group.submit(SeededWorker.fail)  # runs now; the error waits for result() as a Ray call's does
        with pytest.raises(WorkerError, match=r"^the actor worker of rank 0 raised an exception:\n") as caught:
            call.result()
        assert "ValueError: the loss went NaN" in caught.value.summary
        assert isinstance(caught.value.__cause__, ValueError)
        assert group.identity()["role"] == "actor"  # the group stays usable, as a Ray group whose ranks all finished
        with pytest.raises(AttributeError, match="not declared with @register"):
            group.undeclared()
        with pytest.raises(AttributeError, match="is not a method of SeededWorker"):
            group.submit(BrokenWorker.__init__)  # type: ignore[arg-type]
    finally:
        group.shutdown()
    with pytest.raises(RuntimeError, match="the actor worker group is shut down"):
        group.identity()


def test_an_init_error_names_the_role_and_leaves_nothing_behind(pool: InlinePool) -> None:
    with pytest.raises(WorkerError, match="the ref worker of rank 0 raised") as caught:
        InlineGroup(BrokenWorker, pool, "ref")
    assert "FileNotFoundError: no model at /nowhere" in caught.value.summary
    assert not dist.is_initialized()


def test_a_group_of_several_ranks_is_refused(pool: InlinePool) -> None:
    with pytest.raises(ValueError, match=r"use trainer\.backend: ray"):
        InlineGroup(SeededWorker, pool, "actor", 1, ranks_per_dp=2)


class SleepingWorker:
    def __init__(self) -> None:
        self.calls = 0

    @register(dispatch=Dispatch.RANK0)
    def sleep(self, seconds: float) -> int:
        self.calls += 1
        time.sleep(seconds)  # a signal's handler runs in here (sleep returns to Python for it)
        return self.calls


def test_a_stop_signal_interrupts_an_inline_call_after_its_grace(pool: InlinePool) -> None:
    """SIGTERM while an inline call hangs (issue 45 item 4): the first signal asks for the stop; once
    `stop_grace_s` has passed the call is interrupted with `WorkerCallInterrupted` naming it, as Ray's wait gives up.
    A call started after the request (a save's) runs to its end."""
    stopping: list[str] = []
    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    signals.install_stop_handlers(stopping.append, lambda: bool(stopping), wait_grace_s=0.5)
    group = InlineGroup(SleepingWorker, pool, "actor")
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        with pytest.raises(WorkerCallInterrupted, match=r"SIGTERM: the call of 'sleep' on the actor workers"):
            group.sleep(60.0)
        elapsed = time.monotonic() - start
        assert stopping == ["SIGTERM"]
        assert 0.8 <= elapsed < 5.0, elapsed  # 0.3 s to the signal + 0.5 s of grace + the watcher's poll
        assert group.sleep(1.0) == 2  # started after the request: never cut off, though the grace has passed
    finally:
        group.shutdown()
        signals.clear_stop_request()
        for s, handler in saved.items():
            signal.signal(s, handler)
