"""The distillation teacher's role: a frozen model that scores the student's sampled tokens. Forward passes only.

Built like the reference (`easyrl.workers.ref`): the same `TrainableModel` with no optimizer, the same forward head,
run on the student's token ids (the driver checked at start that both share one tokenizer).
"""

from __future__ import annotations

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import TeacherSpec
from easyrl.workers.trainable import TrainableModel


class TeacherWorker(MemoryReporting):
    def __init__(self, spec: TeacherSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger("teacher", self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.trainable = TrainableModel(self.spec.model, self.device)
        self.trainable.offload()

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("teacher", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """The teacher's log-prob of each response token the student sampled: `teacher_log_probs` (B, R)."""
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
        return Batch({"teacher_log_probs": lp})
