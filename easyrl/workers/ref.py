"""The reference role: the frozen initial policy, for the KL term. Forward passes only."""

from __future__ import annotations

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import RefSpec
from easyrl.workers.trainable import TrainableModel


class RefWorker:
    def __init__(self, spec: RefSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.trainable = TrainableModel(self.spec.model, self.device)
        self.trainable.offload()

    @register(dispatch=Dispatch.DP_SPLIT)
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
