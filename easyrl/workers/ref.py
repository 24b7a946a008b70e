"""The reference role: the frozen initial policy, for the KL term. Forward passes only."""

from __future__ import annotations

import os

import torch

from easyrl.config import EasyRLConfig
from easyrl.distributed import Dispatch, register
from easyrl.protocol import Batch
from easyrl.workers.actor import _setup_process
from easyrl.workers.common import batched_log_probs
from easyrl.workers.fsdp import DTYPES, load_model, offload_to_cpu, resident, shard_model
from easyrl.workers.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.packing import forward_options, packed_attn_implementation


class RefWorker(MemoryReporting):
    def __init__(self, cfg: EasyRLConfig) -> None:
        self.cfg = cfg
        self.device = _setup_process(cfg)
        self.rank = int(os.environ.get("RANK", "0"))
        self.ledger = MemoryLedger("ref", self.device, cfg)

    @register(dispatch=Dispatch.ALL)
    def init_model(self) -> None:
        rcfg = self.cfg.worker.ref
        dtype = DTYPES[rcfg.fsdp.torch_dtype] if rcfg.fsdp.torch_dtype else torch.float32
        acfg = self.cfg.worker.actor  # the reference follows the actor's batching, packing and fused head
        attn = packed_attn_implementation() if acfg.padding_free else None
        model = load_model(acfg.model, "causal_lm", dtype, attn_implementation=attn)
        self.fwd_opts = forward_options(acfg)
        model.requires_grad_(False)
        self.model = shard_model(model, rcfg.fsdp, self.device).eval()
        offload_to_cpu(self.model, None, rcfg.offload.offload_params, False)

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref", release=True)  # the engine wakes next on this GPU: hand the forward's blocks back
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The reference policy's log-prob of each response token: `ref_log_probs` (B, R)."""
        micro = self.cfg.worker.ref.micro_batch_size_per_device_for_experience
        micro = micro or self.cfg.worker.actor.micro_batch_size_per_device_for_experience
        temperature = self.cfg.worker.rollout.temperature
        with resident(self.model, None, self.cfg.worker.ref.offload, self.device):
            lp, _ = batched_log_probs(self.model, batch, self.device, temperature, micro, opts=self.fwd_opts)
        return Batch({"ref_log_probs": lp})
