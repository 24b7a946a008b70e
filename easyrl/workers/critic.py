"""The critic role: a value model (the policy's backbone with a one-output token head) for GAE."""

from __future__ import annotations

import torch

from easyrl.algorithms import compute_value_loss
from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.workers.forward_backward import batched_values, response_values, update_model
from easyrl.workers.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import CriticSpec
from easyrl.workers.trainable import TrainedRole


class CriticWorker(TrainedRole, MemoryReporting):
    def __init__(self, spec: CriticSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.ledger = MemoryLedger("critic", self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.build_trainable(self.spec.model, self.device)
        self.trainable.offload()

    def _values(self, mb: Batch) -> torch.Tensor:
        """Value of the state before each response token: (b, R)."""
        return response_values(self.model, mb, self.device, self.spec.model.forward)

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("values", release=True)  # hand the pass's blocks back to the other processes on this GPU
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        with self.trainable.resident(with_optimizer=False):
            micro = self.spec.micro_batch_size_for_experience
            values = batched_values(self.model, batch, self.device, micro, self.spec.model.forward)
        return Batch({"values": values})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("update", release=True)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        self.model.train()

        def loss_fn(mb: Batch, weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            vpreds = self._values(mb)
            loss, metrics = compute_value_loss(
                vpreds=vpreds,
                returns=mb["returns"].to(self.device),
                values=mb["values"].to(self.device),
                response_mask=mb["response_mask"].to(self.device).float(),
                cliprange_value=self.spec.cliprange_value,
                loss_agg_mode=self.spec.update.loss_avg_mode,
            )
            out = {f"critic/{k}": float(v) for k, v in metrics.items()}
            out["critic/vf_loss"] = float(loss.detach())
            out["critic/vpred_mean"] = float(vpreds.detach().mean())
            return loss * weight, out

        with self.trainable.resident():
            return update_model(self.trainable, batch, self.spec.update, loss_fn, prefix="critic")
