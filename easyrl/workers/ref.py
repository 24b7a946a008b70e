"""The reference role: the frozen initial policy, for the KL term. Forward passes only."""

from __future__ import annotations

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import RefSpec
from easyrl.workers.trainable import TrainableModel


class RefWorker(MemoryReporting):
    def __init__(self, spec: RefSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger("ref", self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.trainable = TrainableModel(self.spec.model, self.device)
        self.trainable.offload()

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The reference policy's log-prob of each response token: `ref_log_probs` (B, R)."""
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
        return Batch({"ref_log_probs": lp})
