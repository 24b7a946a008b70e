"""The engines a rollout loop drives, seen from the driver: the actor group itself (the HybridEngine), or, with
`worker.rollout.placement: separate`, rollout workers of their own fed the policy's weights (`SeparateEngines`)."""

from __future__ import annotations

import time
from typing import Any

from easyrl.batch import Batch
from easyrl.rollout import SamplingParams


class SeparateEngines:
    """An `EngineSession` over rollout workers of their own. Before a session, when the policy moved since the
    weights they hold (its version, the `update_actor` calls), the policy's full weights are gathered from the actor
    and handed to every rollout worker; they load them as the session opens.

    The weights travel through the driver and Ray's object store (one copy, shared by the rollout workers): simple and
    exact, and the cost is logged (`timing_s/weight_transfer`, `perf/weight_transfer_gb`). A broadcast group between
    the actor and the rollout workers would skip the driver; that is the next step for models of several GB."""

    def __init__(self, rollout: Any, actor: Any) -> None:
        self.rollout = rollout
        self.actor = actor
        self.version = 0  # both loaded the initial checkpoint: policy version 0

    def push_if_moved(self) -> dict[str, float]:
        """Hand the policy's weights to the rollout workers when it moved since their last ones."""
        version = self.actor.policy_version()
        if version == self.version:
            return {}
        start = time.perf_counter()
        weights = self.actor.full_weights()  # rank 0's full copy on the host (every rank joins the gathers)
        self.rollout.receive_weights(weights, version)
        self.version = version
        # the bytes that travel: a tied alias comes as a copy of its own (`full_weights` clones each name)
        pushed = sum(t.numel() * t.element_size() for t in weights.values())
        return {"timing_s/weight_transfer": time.perf_counter() - start, "perf/weight_transfer_gb": pushed / 2**30}

    def open_rollout(self) -> dict[str, float]:
        return self.push_if_moved() | self.rollout.open_rollout()

    def policy_version(self) -> int:
        return self.actor.policy_version()  # type: ignore[no-any-return]

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.rollout.generate(prompts, params)  # type: ignore[no-any-return]

    def close_rollout(self) -> dict[str, float]:
        return self.rollout.close_rollout()  # type: ignore[no-any-return]

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        pushed = self.push_if_moved()
        rows, timings = self.rollout.generate_sequences(prompts, params)
        return rows, pushed | timings
