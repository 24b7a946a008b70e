"""The actor role: the FSDP2 policy being trained, with its rollout engine in the same process (HybridEngine).

After every update the policy's weights are streamed, one parameter at a time, into the engine in memory;
the engine sleeps while the policy trains and wakes for the next generation.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from easyrl.algorithms import agg_loss, get_policy_loss, kl_penalty
from easyrl.checkpoint import CheckpointMixin
from easyrl.config import EasyRLConfig
from easyrl.config.loader import import_user_modules
from easyrl.distributed import Dispatch, init_distributed, register
from easyrl.protocol import Batch
from easyrl.workers.common import batched_log_probs, optimize, token_log_probs
from easyrl.workers.fsdp import (
    DTYPES,
    build_optimizer,
    build_scheduler,
    iter_full_weights,
    load_model,
    load_to_device,
    offload_to_cpu,
    seed_everything,
    shard_model,
    worker_device,
)
from easyrl.workers.packing import forward_options, packed_attn_implementation
from easyrl.workers.rollout.base import RolloutEngine, SamplingParams


logger = logging.getLogger(__name__)


def _setup_process(cfg: EasyRLConfig) -> torch.device:
    """Per-process setup shared by every role: threads, process group, seed, device."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("EASYRL_NUM_THREADS", "1")))
    init_distributed()
    seed_everything(cfg.trainer.seed)
    import_user_modules(cfg.algorithm.user_modules)
    return worker_device()


def build_rollout_engine(
    cfg: EasyRLConfig, device: torch.device, media_per_prompt: dict[str, int] | None = None
) -> RolloutEngine:
    """The engine named by `worker.rollout.name`, loaded from the actor's model folder. ``media_per_prompt``: the
    most images / videos one prompt of the data carries (an engine that processes pixels sizes itself for it)."""
    from transformers import AutoTokenizer

    model_cfg = cfg.worker.actor.model
    assert model_cfg.model_path is not None and model_cfg.tokenizer_path is not None
    tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path, trust_remote_code=model_cfg.trust_remote_code)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    dtype = DTYPES[cfg.worker.rollout.dtype] if device.type == "cuda" else torch.float32
    if cfg.worker.rollout.name == "hf":
        from easyrl.workers.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model_cfg.model_path, device, dtype, eos, pad, model_cfg.trust_remote_code)
    from easyrl.workers.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(cfg, eos, pad, media_per_prompt or {})


class ActorWorker(CheckpointMixin):
    """Trains the policy (PPO-family losses) and generates rollouts with it."""

    def __init__(self, cfg: EasyRLConfig) -> None:
        self.cfg = cfg
        self.device = _setup_process(cfg)
        self.rank = int(os.environ.get("RANK", "0"))

    @register(dispatch=Dispatch.ALL)
    def init_model(self, total_optimizer_steps: int, media_per_prompt: dict[str, int] | None = None) -> None:
        acfg = self.cfg.worker.actor
        dtype = DTYPES[acfg.fsdp.torch_dtype] if acfg.fsdp.torch_dtype else torch.float32
        attn = packed_attn_implementation() if acfg.padding_free else None
        model = load_model(acfg.model, "causal_lm", dtype, attn_implementation=attn)
        self.fwd_opts = forward_options(acfg)
        self.model = shard_model(model, acfg.fsdp, self.device, acfg.model.enable_gradient_checkpointing)
        self.optimizer = build_optimizer(self.model, acfg.optim)
        self.scheduler = build_scheduler(self.optimizer, acfg.optim, total_optimizer_steps)
        self.engine = build_rollout_engine(self.cfg, self.device, media_per_prompt)
        self._engine_stale = False  # the engine loaded the same checkpoint the policy did

    # ---------------------------------------------------------------- rollout
    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample responses for `prompts` with the current policy weights.

        The ranks of one tensor-parallel engine get the same prompts and must sample alike: the seed is the engine's.
        """
        timing = self._wake_engine()
        rcfg = self.cfg.worker.rollout
        params = SamplingParams(
            n=1,
            temperature=rcfg.temperature,
            top_p=rcfg.top_p,
            top_k=rcfg.top_k,
            max_tokens=self.cfg.data.max_response_length,
            ignore_eos=rcfg.ignore_eos,
            stop_token_ids=tuple(rcfg.stop_token_ids),
        ).override(prompts.meta.get("sampling_overrides", {}))
        engine_rank = self.rank // rcfg.ranks_per_engine
        seed = int(prompts.meta.get("seed", rcfg.seed)) * 1000 + engine_rank
        params = params.override({"seed": seed})
        start = time.perf_counter()
        out = self.engine.generate(prompts, params)
        timing["timing_s/generate_engine"] = time.perf_counter() - start
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else 0
        self.engine.sleep()
        self._engine_stale |= self.engine.discards_weights_on_sleep
        if self.device.type == "cuda":  # what sleeping gave back to the device (weights + KV cache)
            timing["perf/sleep_freed_gb"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
        off = self.cfg.worker.actor.offload
        load_to_device(self.model, self.optimizer, off.offload_params, off.offload_optimizer, self.device)
        timing["timing_s/sleep"] = time.perf_counter() - start
        out.meta["timing"] = timing
        return out

    def _wake_engine(self) -> dict[str, float]:
        """Wake the engine; when the policy changed since it last generated, stream the new weights in
        between waking its weight memory and its KV cache (so both are never resident at once)."""
        off = self.cfg.worker.actor.offload  # training state leaves the GPU while the engine holds it
        if not self._engine_stale:
            start = time.perf_counter()
            offload_to_cpu(self.model, self.optimizer, off.offload_params, off.offload_optimizer)
            self.engine.wake_up()
            return {"timing_s/wake": time.perf_counter() - start}
        start = time.perf_counter()
        self.engine.wake_up(["weights"])
        wake = time.perf_counter() - start
        start = time.perf_counter()
        self.engine.load_weights(iter_full_weights(self.model))
        update = time.perf_counter() - start
        start = time.perf_counter()
        offload_to_cpu(self.model, self.optimizer, off.offload_params, off.offload_optimizer)
        self.engine.wake_up(["kv_cache"])
        wake += time.perf_counter() - start
        self._engine_stale = False
        return {"timing_s/wake": wake, "timing_s/update_weights": update}

    # ---------------------------------------------------------------- training
    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The policy's log-prob (B, R) and entropy (B, R) of each response token before the update."""
        self.model.eval()
        lp, ent = batched_log_probs(
            self.model,
            batch,
            self.device,
            self.cfg.worker.rollout.temperature,
            self.cfg.worker.actor.micro_batch_size_per_device_for_experience,
            with_entropy=True,
            opts=self.fwd_opts,
        )
        assert ent is not None
        return Batch({"old_log_probs": lp, "entropys": ent})

    @register(dispatch=Dispatch.DP_SPLIT)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO-family update over the batch; returns `actor/*` metrics (means over micro-batches)."""
        acfg, alg = self.cfg.worker.actor, self.cfg.algorithm
        self.model.train()
        policy_loss = get_policy_loss(acfg.loss_type)
        entropy_coeff = float(batch.meta.get("entropy_coeff", 0.0))
        temperature = self.cfg.worker.rollout.temperature
        use_kl_loss = alg.use_kl_loss and not alg.disable_kl

        def loss_fn(mb: Batch, weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb["response_mask"].to(self.device).float()
            log_prob, entropy = token_log_probs(
                self.model, mb, self.device, temperature, with_entropy=entropy_coeff != 0, opts=self.fwd_opts
            )
            pg_loss, pg_metrics = policy_loss(
                old_log_prob=mb["old_log_probs"].to(self.device),
                log_prob=log_prob,
                advantages=mb["advantages"].to(self.device),
                response_mask=mask,
                clip_ratio_low=acfg.clip_ratio_low,
                clip_ratio_high=acfg.clip_ratio_high,
                clip_ratio_dual=acfg.clip_ratio_dual,
                tau_positive=acfg.tau_positive,
                tau_negative=acfg.tau_negative,
                loss_agg_mode=acfg.loss_avg_mode,
                rollout_is_weights=mb.tensors.get("rollout_is_weights"),
            )
            loss = pg_loss
            metrics = {f"actor/{k}": float(v) for k, v in pg_metrics.items()}
            metrics["actor/pg_loss"] = float(pg_loss.detach())
            if entropy is not None:
                ent = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=acfg.loss_avg_mode)
                loss = loss - entropy_coeff * ent
                metrics["actor/entropy"] = float(ent.detach())
            if use_kl_loss:
                kl = kl_penalty(
                    log_prob=log_prob, ref_log_prob=mb["ref_log_probs"].to(self.device), kl_penalty=alg.kl_penalty
                )
                kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=acfg.loss_avg_mode)
                loss = loss + alg.kl_coef * kl_loss
                metrics["actor/kl_loss"] = float(kl_loss.detach())
                metrics["actor/kl_coef"] = alg.kl_coef
            return loss * weight, metrics

        mini = acfg.global_batch_size * self.cfg.worker.rollout.n // _world_size()
        metrics = optimize(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            mini_batch_size=mini,
            micro_batch_size=acfg.micro_batch_size_per_device_for_update,
            epochs=acfg.ppo_epochs,
            max_grad_norm=acfg.max_grad_norm,
            loss_fn=loss_fn,
            prefix="actor",
            loss_agg_mode=acfg.loss_avg_mode,
            max_token_len=self.fwd_opts.max_token_len,
        )
        self._engine_stale = True
        return metrics

    @register(dispatch=Dispatch.RANK0)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy as CPU tensors on rank 0 (every rank joins the gathers); for tests and small models."""
        weights = {name: t.cpu().clone() for name, t in iter_full_weights(self.model)}
        return weights if self.rank == 0 else None

    @register(dispatch=Dispatch.ALL)
    def memory_stats(self) -> dict[str, float]:
        """GPU memory of this worker's device (GiB): the PyTorch allocator's peak since the last call (then reset),
        what it holds now, and what the whole device has in use now (the engine's pools and other roles included)."""
        if not torch.cuda.is_available():
            return {}
        free, total = torch.cuda.mem_get_info()
        stats = {
            "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "perf/memory_allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "perf/device_memory_used_gb": (total - free) / 2**30,
        }
        torch.cuda.reset_peak_memory_stats()
        return stats


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
