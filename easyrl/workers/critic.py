"""The critic role: a value model (the policy's backbone with a one-output token head) for GAE."""

from __future__ import annotations

import torch

from easyrl.algorithms import compute_value_loss
from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.forward_backward import MicroBatchLoss, batched_values, response_values, update_model
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import CriticSpec
from easyrl.workers.trainable import TrainedRole


def value_objective(mb: Batch, vpreds: torch.Tensor, cliprange_value: float, loss_agg_mode: str) -> MicroBatchLoss:
    """The critic's clipped value loss over one micro-batch: `mb` on the loss's device (returns, rollout-time values,
    mask) and the current predictions `vpreds` (b, R) from the forward pass."""
    loss, metrics = compute_value_loss(
        vpreds=vpreds,
        returns=mb["returns"],
        values=mb["values"],
        response_mask=mb["loss_mask"].float(),
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
    )
    return MicroBatchLoss(loss, {"critic/vf_loss": loss.detach()}, {f"critic/{k}": v for k, v in metrics.items()})


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

        def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
            cfg = self.spec
            return value_objective(on_device, self._values(mb), cfg.cliprange_value, cfg.update.loss_avg_mode)

        with self.trainable.resident():
            return update_model(self.trainable, batch, self.spec.update, loss_fn, prefix="critic")
