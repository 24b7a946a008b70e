"""The driver's typed handles (`easyrl.trainer.handles`) say what the worker classes do: each protocol method is a
method the worker class declares with `@register`, with the same parameters, and returns what that method returns
after its dispatch gathers the ranks' results. (mypy trusts the protocols: a `WorkerGroup` answers any name, so only
this test ties them to the workers.)"""

from __future__ import annotations

import inspect

import pytest

from easyrl.distributed import Dispatch
from easyrl.distributed.dispatch import registered_methods
from easyrl.trainer import handles
from easyrl.workers.actor import ActorWorker
from easyrl.workers.critic import CriticWorker
from easyrl.workers.ref import RefWorker
from easyrl.workers.rollout_role import RolloutRole
from easyrl.workers.sft import SFTWorker
from easyrl.workers.teacher import TeacherWorker


PAIRS = [
    (handles.ActorGroup, ActorWorker),
    (handles.RolloutGroup, RolloutRole),
    (handles.CriticGroup, CriticWorker),
    (handles.RefGroup, RefWorker),
    (handles.RefSource, ActorWorker),
    (handles.TeacherSource, TeacherWorker),
    (handles.SFTGroup, SFTWorker),
]
RAY_TRACE_CTX = "_ray_trace_ctx"
# The group's own members (`WorkerGroup`'s), not a worker method's.
GROUP_MEMBERS = {"call_async", "shutdown", "submit"}


def gathered(returns: str, dispatch: Dispatch) -> str:
    """The driver's return annotation of a worker method returning `returns` under `dispatch`."""
    if dispatch is Dispatch.ALL:
        return f"list[{returns}]"
    if dispatch is Dispatch.RANK0:  # rank 0 answers: a method that gives None on the other ranks gives a value
        return returns.removesuffix(" | None")
    return returns  # DP_SPLIT, ENGINE_SPLIT: the ranks' batches concatenated, metrics merged; ALL_MERGED: one dict


def protocol_methods(proto: type) -> dict[str, inspect.Signature]:
    names = {n for klass in proto.__mro__ if klass.__module__ == handles.__name__ for n in vars(klass)}
    return {
        n: inspect.signature(getattr(proto, n))
        for n in sorted(names - GROUP_MEMBERS)
        if not n.startswith("_") and callable(getattr(proto, n))
    }


def mismatches(proto: type, worker: type) -> list[str]:
    """One line per protocol method that is not the worker class's registered method as the driver sees it."""
    declared = registered_methods(worker)
    bad = []
    for name, sig in protocol_methods(proto).items():
        if name not in declared:
            bad.append(f"{proto.__name__}.{name}: {worker.__name__} declares no such @register method")
            continue
        theirs = inspect.signature(getattr(worker, name))
        ours = [(p.name, p.annotation, p.default) for p in sig.parameters.values()]
        # Ray injects `_ray_trace_ctx` into an actor class's methods once `ray.remote` has wrapped the class in this
        # process (its tracing hook edits the signatures in place): the driver never passes it
        want = [(p.name, p.annotation, p.default) for p in theirs.parameters.values() if p.name != RAY_TRACE_CTX]
        if ours != want:
            bad.append(f"{proto.__name__}.{name}: parameters {ours} vs {worker.__name__}'s {want}")
        expected = gathered(str(theirs.return_annotation), declared[name].dispatch)
        if sig.return_annotation != expected:
            bad.append(f"{proto.__name__}.{name}: returns {sig.return_annotation} vs {expected} after the dispatch")
    return bad


@pytest.mark.parametrize(("proto", "worker"), PAIRS, ids=[f"{p.__name__}-{w.__name__}" for p, w in PAIRS])
def test_each_protocol_is_its_worker_class_seen_from_the_driver(proto: type, worker: type) -> None:
    assert protocol_methods(proto), f"{proto.__name__} names no call: the test would check nothing"
    assert mismatches(proto, worker) == []


def test_a_protocol_out_of_step_with_its_worker_is_caught() -> None:
    class Drifted(handles.ActorGroup):  # update_actor lost its coefficient; policy_version says list
        def update_actor(self, batch: handles.Batch) -> dict[str, float]: ...  # type: ignore[override]

        def policy_version(self) -> list[int]: ...  # type: ignore[override]

        def generate_twice(self) -> None: ...

    Drifted.__module__ = handles.__name__  # read as one of the protocols
    found = mismatches(Drifted, ActorWorker)
    assert [line.split(":")[0] for line in found] == [
        "Drifted.generate_twice",
        "Drifted.policy_version",
        "Drifted.update_actor",
    ], found
