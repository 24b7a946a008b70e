"""A worker that only generates: a `RolloutWorker` of its own, in a process (and, on GPUs, a device) apart from the
policy: `worker.rollout.placement: separate`. Its engine is resident (it never sleeps: no training shares its
device), and the policy's weights come from the driver (`receive_weights`: full tensors by HF name, the actor's
`full_weights`), loaded at the next `open_rollout`; every row it generates carries the version it was given. The
driver drives it through the same `EngineSession` calls as the actor's HybridEngine, so any
`easyrl.rollout.RolloutLoop` runs on either.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting
from easyrl.distributed.weight_bus import BusAddress, TensorEntry, WeightBus
from easyrl.rollout import SamplingParams, WeightSync
from easyrl.rollout.worker import RolloutWorker
from easyrl.workers.model_setup import setup_process
from easyrl.workers.session import OneCallSession
from easyrl.workers.specs import RolloutRoleSpec


class ReceivedWeights:
    """Full weights handed over by the driver, as a `WeightSource`: a full policy's, or a LoRA policy's merged."""

    def __init__(self, weights: dict[str, torch.Tensor], merged_lora: bool) -> None:
        self.weights = weights
        self.lora = merged_lora  # the spec's sync mode expects a LoRA source when the weights are merged adapters

    def full_weights(self, aliases: bool) -> Iterator[tuple[str, torch.Tensor]]:
        # The driver's copy has every name, tied aliases included: an engine that loads them once sees the same
        # tensor twice, which is harmless.
        del aliases
        yield from self.weights.items()

    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError("a rollout worker of its own receives full (merged) weights, not adapters")


class RolloutRole(MemoryReporting, OneCallSession):
    """Generates with the weights it was last given; never trains."""

    def __init__(self, spec: RolloutRoleSpec) -> None:
        if spec.rollout.weight_sync is WeightSync.ADAPTER:
            raise ValueError(
                "a rollout worker of its own receives full weights: set worker.actor.model.lora.rollout_sync=merged"
            )
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger("rollout", self.device, spec.memory_levers)
        self._weights: ReceivedWeights | None = None
        self._version = 0

    @register(dispatch=Dispatch.ALL)
    def init_model(self, media_per_prompt: dict[str, int] | None = None) -> None:
        """Load the engine from the policy's checkpoint (policy version 0)."""
        # resident: this process shares its device with no training, so the engine never sleeps
        self.rollout = RolloutWorker(self.spec.rollout, self.device, self.ledger, media_per_prompt, sleeps=False)

    @register(dispatch=Dispatch.ALL)
    def receive_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Keep policy `version`'s full weights (HF names, tied aliases included) for the next session, which loads
        them: an update lands between generations, never inside one."""
        self._weights = ReceivedWeights(weights, self.spec.rollout.weight_sync is WeightSync.MERGED_LORA)
        self._version = version
        self.rollout.stale = True

    @register(dispatch=Dispatch.ALL)
    def join_weight_bus(self, address: BusAddress) -> None:
        """Join the policy's weight bus as a receiver (rank 1 + this worker's rank: the policy's rank 0 sends)."""
        import torch.distributed as dist

        self._bus = WeightBus(address, 1 + dist.get_rank(), self.device)

    @register(dispatch=Dispatch.ALL)
    def receive_broadcast(self, manifest: list[TensorEntry], version: int) -> None:
        """`receive_weights` over the bus: the tensors of `manifest`, in its order, as the policy's rank 0 sends them
        (its `broadcast_weights` runs meanwhile)."""
        # Held on the bus's device until the next `open_rollout` loads them: on a GPU that is a second copy of the
        # weights beside the engine's for that moment (the push comes right before the session opens). A GPU check
        # owed: whether it fits beside an engine at a high gpu_memory_utilization (else: load as they arrive).
        weights = {entry.name: self._bus.receive(entry) for entry in manifest}
        self.receive_weights(weights, version)

    @register(dispatch=Dispatch.ALL_MERGED)
    def open_rollout(self) -> dict[str, float]:
        """Load the weights received since the last session into the engine (then dropped here: it holds them)."""
        # nothing to make room for: no training state lives in this process
        source = self._weights or ReceivedWeights({}, merged_lora=False)  # not read unless the engine is stale
        if self._weights is not None:
            # Weights held in host memory stay the source of a rebuilt engine (a dead engine's restart): no copy
            # beyond these. Weights the bus landed on a GPU are dropped (a second copy beside the engine's): an
            # engine there that cannot recover in place stops the run.
            on_host = all(t.device.type == "cpu" for t in self._weights.weights.values())
            self.rollout.rebuild_source = self._weights if on_host else None
        timing = self.rollout.open(source, self._version, make_room=lambda: None)
        self._weights = None  # the resident engine holds them now (and `rebuild_source`, when on the host)
        return timing

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """`params.n` samples per prompt with the weights the engine holds, each row stamped with their version."""
        return self.rollout.generate(prompts, params)

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate_beside(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """`generate_sequences` issued while the policy trains (the carry-over loop's call beside the update), with its
        wall-clock start and end (`async/beside_start_time`, `async/beside_end_time`: unix seconds, the clock the
        driver compares with its own to tell how much of the call overlapped training)."""
        start = time.time()
        rows, timing = self.generate_sequences(prompts, params)
        return rows, timing | {"async/beside_start_time": start, "async/beside_end_time": time.time()}

    @register(dispatch=Dispatch.ALL_MERGED)
    def close_rollout(self) -> dict[str, float]:
        """End the session (the engine stays resident)."""
        return self.rollout.close()
