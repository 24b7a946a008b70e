"""The SFT role: the policy trained on the next-token loss of the assistant's tokens (`easyrl sft`).

It is the actor's training machinery with another objective: the same `TrainableModel` (FSDP2, LoRA, Ulysses,
offload), the same forward head (`token_log_probs_and_top1`: padded, trimmed or packed rows, the fused chunked head,
sequence parallelism) and the same update loop (`update_model`: token-budget micro-batches, micro-batch and rank
weights, gradient clipping, non-finite skips), and the same checkpoints. No rollout engine.
"""

from __future__ import annotations

import os

import torch

from easyrl.algorithms.sft import nll_loss, token_accuracy
from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.batching import make_micro_batches
from easyrl.workers.forward_backward import MicroBatchLoss, sum_over_ranks, update_model
from easyrl.workers.head import token_log_probs_and_top1
from easyrl.workers.model_setup import setup_process
from easyrl.workers.specs import SFTSpec
from easyrl.workers.trainable import TrainedRole


def sft_objective(mb: Batch, log_prob: torch.Tensor, top1: torch.Tensor, loss_agg_mode: str) -> MicroBatchLoss:
    """One micro-batch's loss: the NLL of its trained tokens (`mb["loss_mask"]` (b, R), on the loss's device) under
    `log_prob` (b, R), aggregated with `loss_agg_mode`; the token accuracy from `top1` (b, R) as a token mean."""
    mask = mb["loss_mask"].float()
    loss = nll_loss(log_prob, mask, loss_agg_mode)
    return MicroBatchLoss(loss, {"train/loss": loss.detach()}, {"train/token_accuracy": token_accuracy(top1, mask)})


class SFTWorker(TrainedRole, MemoryReporting):
    """Trains the policy on conversations; its checkpoints are the actor's (`easyrl merge` reads them as such)."""

    def __init__(self, spec: SFTSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.rank = int(os.environ.get("RANK", "0"))
        self.ledger = MemoryLedger("actor", self.device)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        self.build_trainable(self.spec.model, self.device)

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("update")
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's rows of the step); returns `train/*` metrics, each the
        value over all ranks' rows (`train/loss`, `train/token_accuracy`, `train/grad_norm`, `train/lr`, ...)."""
        self.model.train()
        opts, agg = self.spec.model.forward, self.spec.update.loss_avg_mode

        def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
            # the forward lays rows out from the host copy; the loss reads the device copy only
            log_prob, top1 = token_log_probs_and_top1(self.model, mb, self.device, opts)
            return sft_objective(on_device, log_prob, top1, agg)

        metrics = update_model(self.trainable, batch, self.spec.update, loss_fn, prefix="train")
        return metrics | self.trainable.state_sizes()

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("val")
    @torch.no_grad()
    def evaluate(self, batch: Batch) -> dict[str, float]:
        """Sums over every rank's trained tokens of `batch`: `nll_sum`, `top1_sum` and `tokens` (the driver adds the
        batches up; rows the driver added to fill every rank carry an all-zero `loss_mask` and count for nothing)."""
        self.model.eval()
        opts = self.spec.model.forward
        mbs = make_micro_batches(batch, self.spec.micro_batch_size_for_experience, opts.max_token_len)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for mb, dummy in zip(mbs.parts, mbs.dummy):
            # every part runs, dummies too: each rank must join the same number of FSDP collectives
            log_prob, top1 = token_log_probs_and_top1(self.model, mb, self.device, opts)
            if dummy:
                continue
            mask = mb["loss_mask"].to(self.device) != 0
            nll = torch.where(mask, -log_prob.double(), 0.0)  # select, not multiply: padding may hold any value
            sums += torch.stack([nll.sum(), torch.where(mask, top1.double(), 0.0).sum(), mask.double().sum()])
        nll, top1_sum, tokens = sum_over_ranks(sums, opts.sp_size).tolist()
        return {"nll_sum": nll, "top1_sum": top1_sum, "tokens": tokens}

    @register(dispatch=Dispatch.RANK0)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy as CPU tensors on rank 0 (every rank joins the gathers); for tests and small models."""
        weights = {name: t.cpu().clone() for name, t in self.trainable.full_weights(aliases=True)}
        return weights if self.rank == 0 else None
