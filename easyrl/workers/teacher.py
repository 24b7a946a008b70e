"""The distillation teacher's role: a frozen model that scores the student's sampled tokens. Forward passes only.

Built like the reference (`easyrl.workers.ref.FrozenScorer`): the same `TrainableModel` with no optimizer, the same
forward head, run on the student's token ids (the driver checked at start that both share one tokenizer).
"""

from __future__ import annotations

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import peak_memory
from easyrl.workers.ref import FrozenScorer


class TeacherWorker(FrozenScorer):
    role = "teacher"

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("teacher", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """The teacher's log-prob of each response token the student sampled: `teacher_log_probs` (B, R)."""
        return Batch({"teacher_log_probs": self.token_log_probs(batch)})
