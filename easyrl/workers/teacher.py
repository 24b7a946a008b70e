"""The distillation teacher's role: a frozen model that scores the student's sampled tokens. Forward passes only.

Built like the reference (`easyrl.workers.ref.FrozenScorer`): the same `TrainableModel` with no optimizer, the same
forward head, run on the student's token ids (the driver checked at start that both share one tokenizer).
"""

from __future__ import annotations

import torch

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import peak_memory
from easyrl.workers.batching import make_micro_batches
from easyrl.workers.head import top_k_log_probs
from easyrl.workers.ref import FrozenScorer
from easyrl.workers.specs import TeacherSpec


class TeacherWorker(FrozenScorer):
    role = "teacher"
    spec: TeacherSpec

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("teacher", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """The teacher's log-prob of each response token the student sampled: `teacher_log_probs` (B, R); with
        `top_k` (`topk_fkl`) also its k most likely tokens at each position: `teacher_topk_ids` (B, R, k) and
        `teacher_topk_log_probs` (B, R, k)."""
        if not self.spec.top_k:
            return Batch({"teacher_log_probs": self.token_log_probs(batch)})
        return Batch(self._top_k(batch))

    @torch.no_grad()
    def _top_k(self, batch: Batch) -> dict[str, torch.Tensor]:
        spec = self.spec
        mbs = make_micro_batches(batch, spec.micro_batch_size_for_experience, spec.model.forward.max_token_len)
        parts: list[tuple[torch.Tensor, ...]] = []
        with self.trainable.resident():
            for mb, dummy in zip(mbs.parts, mbs.dummy):
                out = top_k_log_probs(
                    self.trainable.module, mb, self.device, spec.temperature, spec.top_k, spec.model.forward
                )
                if not dummy:  # a dummy runs only so every rank joins the same FSDP collectives
                    parts.append(tuple(t.cpu() for t in out))
        keys = ("teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids")
        # In the batch's order again: token-budget micro-batches permute the rows.
        return {key: mbs.restore(torch.cat([p[i] for p in parts])) for i, key in enumerate(keys)}
