"""The reference role: the frozen initial policy, for the KL term. Forward passes only. `FrozenScorer` is what every
frozen model that scores the policy's sampled tokens shares (the reference here, the distillation teacher in
`easyrl.workers.teacher`)."""

from __future__ import annotations

import torch

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import RefSpec, TeacherSpec
from easyrl.workers.trainable import TrainableModel


class FrozenScorer(MemoryReporting):
    """A `TrainableModel` with no optimizer, off the device between its forward passes; `role` names its ledger."""

    role = "frozen"

    def __init__(self, spec: RefSpec | TeacherSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger(self.role, self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.trainable = TrainableModel(self.spec.model, self.device)
        self.trainable.offload()

    def token_log_probs(self, batch: Batch) -> torch.Tensor:
        """The model's log-prob of each response token (B, R), at the policy's temperature."""
        spec = self.spec
        with self.trainable.resident():
            lp, _ = batched_log_probs(
                self.trainable.module,
                batch,
                self.device,
                spec.temperature,
                spec.micro_batch_size_for_experience,
                opts=spec.model.forward,
            )
        return lp


class RefWorker(FrozenScorer):
    role = "ref"

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The reference policy's log-prob of each response token: `ref_log_probs` (B, R)."""
        return Batch({"ref_log_probs": self.token_log_probs(batch)})
