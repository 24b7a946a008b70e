"""The driver's view of its worker groups, typed: what `fit()` and the engines call on each role.

A `WorkerGroup` answers any method its worker class declares with `@register` (through `__getattr__`), so mypy
would see every such call as `Any`. These protocols name the calls the driver makes, with the types the driver
gets back after the dispatch gathers the ranks' results (`easyrl.distributed.Dispatch`): `DP_SPLIT` and
`ENGINE_SPLIT` give the batch (or metrics) of all ranks, `ALL` the list of the ranks' results, `ALL_MERGED` one
dict of metrics, `RANK0` rank 0's result. A call started without waiting goes through `submit` with the worker
class's method itself, never its name, so mypy checks it too. `tests/trainer/test_handles.py` keeps each protocol
in step with the worker class behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, runtime_checkable

from easyrl.batch import Batch


if TYPE_CHECKING:
    import torch

    from easyrl.distributed import GroupCall
    from easyrl.distributed.weight_bus import BusAddress, TensorEntry
    from easyrl.rollout.engine import SamplingParams
    from easyrl.workers.actor import ActorWorker
    from easyrl.workers.rollout_role import RolloutRole


__all__ = [
    "ActorGroup",
    "CriticGroup",
    "GroupHandle",
    "RefGroup",
    "RefSource",
    "RolloutGroup",
    "SFTGroup",
    "TeacherSource",
]

P = ParamSpec("P")


@runtime_checkable  # `Workers` tells its groups (Ray's or inline) from a remote teacher's client by it
class GroupHandle(Protocol):
    """Any worker group: the lifecycle calls every role declares (`init_model`, `memory_stats`, checkpoints) go by
    name to groups of different roles alike; and its end."""

    role: str
    world_size: int

    def call_async(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> GroupCall: ...

    def shutdown(self) -> None: ...


class ActorGroup(GroupHandle, Protocol):
    """The policy's group (`easyrl.workers.actor.ActorWorker`): trains, and with colocated engines generates."""

    def open_rollout(self) -> dict[str, float]: ...

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]: ...

    def close_rollout(self) -> dict[str, float]: ...

    def set_policy_version(self, version: int) -> list[None]: ...

    def policy_version(self) -> int: ...

    def compute_log_probs(self, batch: Batch) -> Batch: ...

    def compute_ref_log_probs(self, batch: Batch) -> Batch: ...

    def update_actor(self, batch: Batch, entropy_coeff: float) -> dict[str, float]: ...

    def full_weights(self) -> dict[str, torch.Tensor]: ...

    def weight_manifest(self) -> list[TensorEntry]: ...

    def weight_bus_address(self, world_size: int) -> BusAddress: ...

    def submit(
        self, method: Callable[Concatenate[ActorWorker, P], Any], *args: P.args, **kwargs: P.kwargs
    ) -> GroupCall: ...


class RolloutGroup(GroupHandle, Protocol):
    """Rollout workers of their own (`worker.rollout.placement: separate`, `easyrl.workers.rollout_role`)."""

    def open_rollout(self) -> dict[str, float]: ...

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]: ...

    def close_rollout(self) -> dict[str, float]: ...

    def receive_weights(self, weights: dict[str, torch.Tensor], version: int) -> list[None]: ...

    def submit(
        self, method: Callable[Concatenate[RolloutRole, P], Any], *args: P.args, **kwargs: P.kwargs
    ) -> GroupCall: ...


class CriticGroup(GroupHandle, Protocol):
    """The value model's group (`easyrl.workers.critic.CriticWorker`)."""

    def compute_values(self, batch: Batch) -> Batch: ...

    def update_critic(self, batch: Batch) -> dict[str, float]: ...


class RefSource(Protocol):
    """Who answers the reference log-probs: the reference group, or a LoRA actor (its base, adapters off)."""

    def compute_ref_log_probs(self, batch: Batch) -> Batch: ...


class RefGroup(GroupHandle, RefSource, Protocol):
    """The reference model's group (`easyrl.workers.ref.RefWorker`)."""


class TeacherSource(Protocol):
    """Who answers the teacher's log-probs: the teacher group, or a remote teacher's client
    (`easyrl.scorers.teacher.RemoteTeacher`)."""

    def compute_teacher_log_probs(self, batch: Batch) -> Batch: ...


class SFTGroup(GroupHandle, Protocol):
    """`easyrl sft`'s policy group (`easyrl.workers.sft.SFTWorker`)."""

    def train_step(self, batch: Batch) -> dict[str, float]: ...

    def evaluate(self, batch: Batch) -> dict[str, float]: ...

    def full_weights(self) -> dict[str, torch.Tensor]: ...
