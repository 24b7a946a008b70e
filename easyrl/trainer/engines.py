"""The engines a rollout loop drives, seen from the driver: the actor group itself (the HybridEngine), or, with
`worker.rollout.placement: separate`, rollout workers of their own fed the policy's weights (`SeparateEngines`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from easyrl.batch import Batch
from easyrl.distributed.weight_bus import TensorEntry, manifest_bytes
from easyrl.rollout import SamplingParams


if TYPE_CHECKING:
    from easyrl.distributed import GroupCall
    from easyrl.trainer.handles import ActorGroup, RolloutGroup


class SeparateEngines:
    """An `EngineSession` over rollout workers of their own. Before a session, when the policy moved since the
    weights they hold (its version, the `update_actor` calls), the policy's full weights are gathered from the actor
    and handed to every rollout worker; they load them as the session opens.

    How the weights travel (`worker.rollout.weight_transfer`): `broadcast`, over a process group of their own between
    the policy's rank 0 and every rollout worker (`easyrl.distributed.weight_bus`), one tensor at a time, set up at
    the first push; or `driver`, the whole policy gathered on rank 0's host and handed over through the driver and
    Ray's object store (one copy, shared by the rollout workers). Both are exact; the cost is logged
    (`timing_s/weight_transfer`, `perf/weight_transfer_gb`)."""

    def __init__(self, rollout: RolloutGroup, actor: ActorGroup, transfer: str = "broadcast") -> None:
        self.rollout = rollout
        self.actor = actor
        self.transfer = transfer
        self.version = 0  # both loaded the initial checkpoint: policy version 0
        self.manifest: list[TensorEntry] | None = None  # the broadcasts' names, shapes and dtypes, once the bus is up
        self.beside: GroupCall | None = None  # the last call started beside training

    def push_if_moved(self) -> dict[str, float]:
        """Hand the policy's weights to the rollout workers when it moved since their last ones."""
        version = self.actor.policy_version()
        if version == self.version:
            return {}
        start = time.perf_counter()
        if self.transfer == "broadcast":
            pushed = self._broadcast(version)
        else:
            weights = self.actor.full_weights()  # rank 0's full copy on the host (every rank joins the gathers)
            self.rollout.receive_weights(weights, version)
            # the bytes that travel: a tied alias comes as a copy of its own (`full_weights` clones each name)
            pushed = sum(t.numel() * t.element_size() for t in weights.values())
        self.version = version
        return {"timing_s/weight_transfer": time.perf_counter() - start, "perf/weight_transfer_gb": pushed / 2**30}

    def _broadcast(self, version: int) -> int:
        """Send the policy over the weight bus (joined at the first push); returns the bytes sent."""
        from easyrl.workers.actor import ActorWorker
        from easyrl.workers.rollout_role import RolloutRole

        if self.manifest is None:
            self.manifest = self.actor.weight_manifest()
            address = self.actor.weight_bus_address(1 + self.rollout.world_size)
            # Both sides at once: joining blocks until the whole group has connected.
            calls = [
                self.actor.submit(ActorWorker.join_weight_bus, address),
                self.rollout.submit(RolloutRole.join_weight_bus, address),
            ]
            for call in calls:
                call.result()
        for call in self._push(self.manifest, version):
            call.result()
        return manifest_bytes(self.manifest)

    def _push(self, manifest: list[TensorEntry], version: int) -> list[GroupCall]:
        """Start one broadcast of the policy over the bus (already up): the actor's rank 0 sends, every rollout
        worker receives."""
        from easyrl.workers.actor import ActorWorker
        from easyrl.workers.rollout_role import RolloutRole

        return [
            self.actor.submit(ActorWorker.broadcast_weights),
            self.rollout.submit(RolloutRole.receive_broadcast, manifest, version),
        ]

    def open_rollout(self) -> dict[str, float]:
        return self.push_if_moved() | self.rollout.open_rollout()

    def policy_version(self) -> int:
        return self.actor.policy_version()

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.rollout.generate(prompts, params)

    def close_rollout(self) -> dict[str, float]:
        return self.rollout.close_rollout()

    def generate_beside(self, prompts: Batch, params: SamplingParams) -> tuple[dict[str, float], Any]:
        """Start one open-generate-close on the rollout workers and return at once, with the push's figures and the
        call (`.result()`: the rows and the session's timings). The policy's weights are pushed first when it moved,
        so the call never samples with weights older than the policy's now (the staleness bound rests on it).

        Over a bus already up, the push is started too, not waited for: Ray runs an actor's calls in the order the
        driver made them, so the actor sends these weights before the update the driver asks for next, and the
        rollout workers receive them before they generate. Its cost then lands in the actor's next call (beside the
        driver's reward stage) instead of on the driver's path; `timing_s/weight_transfer` is not measured then."""
        from easyrl.workers.rollout_role import RolloutRole

        version = self.actor.policy_version()
        pushed: dict[str, float] = {}
        pushes: list[GroupCall] = []
        if version != self.version and self.transfer == "broadcast" and self.manifest is not None:
            pushes = self._push(self.manifest, version)
            self.version = version
            pushed = {"perf/weight_transfer_gb": manifest_bytes(self.manifest) / 2**30}
        else:  # the bus's first push (its rendezvous) or through the driver: waited for
            pushed = self.push_if_moved()
        self.beside = self.rollout.submit(RolloutRole.generate_beside, prompts, params)
        return pushed, PushedThenGenerated(pushes, self.beside)

    def generating(self) -> bool:
        """Whether a call started beside training still runs (any other call to the rollout workers queues behind
        it: the driver asks them nothing it does not need meanwhile)."""
        return self.beside is not None and not self.beside.done()

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        pushed = self.push_if_moved()
        rows, timings = self.rollout.generate_sequences(prompts, params)
        return rows, pushed | timings


class PushedThenGenerated:
    """A call beside the training and the weight push started before it: `result` waits for both (a failed push
    surfaces here) and gives the call's rows and timings."""

    def __init__(self, pushes: list[GroupCall], call: GroupCall) -> None:
        self.pushes, self.call = pushes, call

    def result(self) -> tuple[Batch, dict[str, float]]:
        for push in self.pushes:
            push.result()
        return self.call.result()  # type: ignore[no-any-return]
