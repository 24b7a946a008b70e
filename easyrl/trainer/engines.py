"""The engines a rollout loop drives, seen from the driver: the actor group itself (the HybridEngine), or, with
`worker.rollout.placement: separate`, rollout workers of their own fed the policy's weights (`SeparateEngines`)."""

from __future__ import annotations

import time
from typing import Any

from easyrl.batch import Batch
from easyrl.distributed.weight_bus import manifest_bytes
from easyrl.rollout import SamplingParams


class SeparateEngines:
    """An `EngineSession` over rollout workers of their own. Before a session, when the policy moved since the
    weights they hold (its version, the `update_actor` calls), the policy's full weights are gathered from the actor
    and handed to every rollout worker; they load them as the session opens.

    How the weights travel (`worker.rollout.weight_transfer`): `broadcast`, over a process group of their own between
    the policy's rank 0 and every rollout worker (`easyrl.distributed.weight_bus`), one tensor at a time, set up at
    the first push; or `driver`, the whole policy gathered on rank 0's host and handed over through the driver and
    Ray's object store (one copy, shared by the rollout workers). Both are exact; the cost is logged
    (`timing_s/weight_transfer`, `perf/weight_transfer_gb`)."""

    def __init__(self, rollout: Any, actor: Any, transfer: str = "broadcast") -> None:
        self.rollout = rollout
        self.actor = actor
        self.transfer = transfer
        self.version = 0  # both loaded the initial checkpoint: policy version 0
        self.manifest: list[Any] | None = None  # the broadcasts' names, shapes and dtypes, once the bus is up
        self.beside: Any = None  # the last call started beside training (a `GroupCall`)

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
        if self.manifest is None:
            self.manifest = self.actor.weight_manifest()
            address = self.actor.weight_bus_address(1 + self.rollout.world_size)
            # Both sides at once: joining blocks until the whole group has connected.
            calls = [
                self.actor.call_async("join_weight_bus", address),
                self.rollout.call_async("join_weight_bus", address),
            ]
            for call in calls:
                call.result()
        calls = [
            self.actor.call_async("broadcast_weights"),
            self.rollout.call_async("receive_broadcast", self.manifest, version),
        ]
        for call in calls:
            call.result()
        return manifest_bytes(self.manifest)

    def open_rollout(self) -> dict[str, float]:
        return self.push_if_moved() | self.rollout.open_rollout()

    def policy_version(self) -> int:
        return self.actor.policy_version()  # type: ignore[no-any-return]

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.rollout.generate(prompts, params)  # type: ignore[no-any-return]

    def close_rollout(self) -> dict[str, float]:
        return self.rollout.close_rollout()  # type: ignore[no-any-return]

    def generate_beside(self, prompts: Batch, params: SamplingParams) -> tuple[dict[str, float], Any]:
        """Start one open-generate-close on the rollout workers and return at once, with the push's figures and the
        call (`.result()`: the rows and the session's timings). The policy's weights are pushed first when it moved,
        so the call never samples with weights older than the policy's now (the staleness bound rests on it).

        Over a bus already up, the push is started too, not waited for: Ray runs an actor's calls in the order the
        driver made them, so the actor sends these weights before the update the driver asks for next, and the
        rollout workers receive them before they generate. Its cost then lands in the actor's next call (beside the
        driver's reward stage) instead of on the driver's path; `timing_s/weight_transfer` is not measured then."""
        version = self.actor.policy_version()
        pushed: dict[str, float] = {}
        pushes: list[Any] = []
        if version != self.version and self.transfer == "broadcast" and self.manifest is not None:
            pushes = [
                self.actor.call_async("broadcast_weights"),
                self.rollout.call_async("receive_broadcast", self.manifest, version),
            ]
            self.version = version
            pushed = {"perf/weight_transfer_gb": manifest_bytes(self.manifest) / 2**30}
        else:  # the bus's first push (its rendezvous) or through the driver: waited for
            pushed = self.push_if_moved()
        self.beside = self.rollout.call_async("generate_beside", prompts, params)
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

    def __init__(self, pushes: list[Any], call: Any) -> None:
        self.pushes, self.call = pushes, call

    def result(self) -> tuple[Batch, dict[str, float]]:
        for push in self.pushes:
            push.result()
        return self.call.result()  # type: ignore[no-any-return]
