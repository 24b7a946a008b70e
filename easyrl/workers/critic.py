"""The critic role: a value model (the policy's backbone with a one-output token head) for GAE."""

from __future__ import annotations

import torch

from easyrl.algorithms import compute_value_loss
from easyrl.checkpoint import CheckpointMixin
from easyrl.config import EasyRLConfig
from easyrl.distributed import Dispatch, register
from easyrl.protocol import Batch
from easyrl.workers.actor import _setup_process, _world_size
from easyrl.workers.common import batched_values, optimize, response_values
from easyrl.workers.fsdp import (
    DTYPES,
    build_optimizer,
    build_scheduler,
    load_model,
    offload_to_cpu,
    resident,
    shard_model,
)
from easyrl.workers.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.packing import ForwardOptions, forward_options, packed_attn_implementation


class CriticWorker(CheckpointMixin, MemoryReporting):
    def __init__(self, cfg: EasyRLConfig) -> None:
        self.cfg = cfg
        self.device = _setup_process(cfg)
        self.ledger = MemoryLedger("critic", self.device, cfg)

    @register(dispatch=Dispatch.ALL)
    def init_model(self, total_optimizer_steps: int) -> None:
        ccfg = self.cfg.worker.critic
        dtype = DTYPES[ccfg.fsdp.torch_dtype] if ccfg.fsdp.torch_dtype else torch.float32
        acfg = self.cfg.worker.actor  # the critic follows the actor's batching and packing (no fused head: 1 output)
        attn = packed_attn_implementation() if acfg.padding_free else None
        model = load_model(ccfg.model, "value", dtype, attn_implementation=attn)
        self.fwd_opts = ForwardOptions(
            padding_free=acfg.padding_free, max_token_len=forward_options(acfg).max_token_len
        )
        self.model = shard_model(model, ccfg.fsdp, self.device, ccfg.model.enable_gradient_checkpointing)
        self.optimizer = build_optimizer(self.model, ccfg.optim)
        self.scheduler = build_scheduler(self.optimizer, ccfg.optim, total_optimizer_steps)
        offload_to_cpu(self.model, self.optimizer, ccfg.offload.offload_params, ccfg.offload.offload_optimizer)

    def _values(self, mb: Batch) -> torch.Tensor:
        """Value of the state before each response token: (b, R)."""
        return response_values(self.model, mb, self.device, self.fwd_opts)

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("values", release=True)  # hand the pass's blocks back to the other processes on this GPU
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        micro = self.cfg.worker.critic.micro_batch_size_per_device_for_experience
        with resident(self.model, None, self.cfg.worker.critic.offload, self.device):
            values = batched_values(self.model, batch, self.device, micro, self.fwd_opts)
        return Batch({"values": values})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("update", release=True)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        ccfg = self.cfg.worker.critic
        self.model.train()

        def loss_fn(mb: Batch, weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            vpreds = self._values(mb)
            loss, metrics = compute_value_loss(
                vpreds=vpreds,
                returns=mb["returns"].to(self.device),
                values=mb["values"].to(self.device),
                response_mask=mb["response_mask"].to(self.device).float(),
                cliprange_value=ccfg.cliprange_value,
                loss_agg_mode=ccfg.loss_avg_mode,
            )
            out = {f"critic/{k}": float(v) for k, v in metrics.items()}
            out["critic/vf_loss"] = float(loss.detach())
            out["critic/vpred_mean"] = float(vpreds.detach().mean())
            return loss * weight, out

        mini = ccfg.global_batch_size * self.cfg.worker.rollout.n // _world_size()
        with resident(self.model, self.optimizer, ccfg.offload, self.device):
            return optimize(
                self.model,
                self.optimizer,
                self.scheduler,
                batch,
                mini_batch_size=mini,
                micro_batch_size=ccfg.micro_batch_size_per_device_for_update,
                epochs=ccfg.ppo_epochs,
                max_grad_norm=ccfg.max_grad_norm,
                loss_fn=loss_fn,
                prefix="critic",
                loss_agg_mode=ccfg.loss_avg_mode,
                max_token_len=self.fwd_opts.max_token_len,
            )
