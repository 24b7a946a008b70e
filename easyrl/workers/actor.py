"""The actor role: the FSDP2 policy being trained, with its rollout engine in the same process (HybridEngine).

After every update the policy's weights are streamed, one parameter at a time, into the engine in memory;
the engine sleeps while the policy trains and wakes for the next generation.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from easyrl.algorithms import agg_loss, kl_penalty, policy_loss_with_params
from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.seeding import SEED_COLUMN
from easyrl.workers.forward_backward import (
    LossFn,
    MicroBatchLoss,
    batched_log_probs,
    token_log_probs,
    update_model,
)
from easyrl.workers.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.workers.model_setup import DTYPES, setup_process
from easyrl.workers.rollout.base import RolloutEngine, SamplingParams
from easyrl.workers.specs import ActorSpec, PolicyLossSpec, RolloutSpec, WeightSync
from easyrl.workers.trainable import TrainedRole


logger = logging.getLogger(__name__)


def build_rollout_engine(
    spec: RolloutSpec, device: torch.device, media_per_prompt: dict[str, int] | None = None
) -> RolloutEngine:
    """The engine named by `worker.rollout.name`, loaded from the actor's model folder. ``media_per_prompt``: the
    most images / videos one prompt of the data carries (an engine that processes pixels sizes itself for it)."""
    from transformers import AutoTokenizer

    model_cfg = spec.model
    assert model_cfg.model_path is not None and model_cfg.tokenizer_path is not None
    tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path, trust_remote_code=model_cfg.trust_remote_code)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    dtype = DTYPES[spec.config.dtype] if device.type == "cuda" else torch.float32
    if spec.config.name == "hf":
        from easyrl.workers.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model_cfg.model_path, device, dtype, eos, pad, model_cfg.trust_remote_code)
    from easyrl.workers.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(spec, eos, pad, media_per_prompt or {})


def policy_objective(
    mb: Batch,
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    spec: PolicyLossSpec,
    loss_agg_mode: str,
    entropy_coeff: float,
) -> MicroBatchLoss:
    """The actor's objective over one micro-batch: the policy loss, minus the entropy bonus, plus the KL loss.

    `mb` is the micro-batch on the loss's device, and the only source of the per-token tensors used here (old and
    reference log-probs, advantages, mask, truncated IS weights), beside the current `log_prob` and `entropy` (b, R)
    from the forward pass: a tensor left on the host would fail on a GPU run. Without `old_log_probs` (the driver
    skipped the old-log-prob pass: one epoch over one mini-batch) they are `log_prob` detached: this forward runs
    the weights the pass would have run, so the ratio is 1 and the gradient the same.
    """
    mask = mb["loss_mask"].float()
    old_log_prob = mb.tensors.get("old_log_probs")
    # the loss's own params class, rebuilt here from the spec's pairs (the worker's registry knows a user's class)
    policy_loss = policy_loss_with_params(spec.loss_type, spec.params)
    pg_loss, pg_metrics = policy_loss(
        old_log_prob=log_prob.detach() if old_log_prob is None else old_log_prob,
        log_prob=log_prob,
        advantages=mb["advantages"],
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=mb.tensors.get("rollout_is_weights"),
    )
    loss = pg_loss
    terms = {"actor/pg_loss": pg_loss.detach()}
    if entropy is not None:
        ent = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=loss_agg_mode)
        loss = loss - entropy_coeff * ent
        terms["actor/entropy"] = ent.detach()
    if spec.kl_in_loss:
        kl = kl_penalty(log_prob=log_prob, ref_log_prob=mb["ref_log_probs"], kl_penalty=spec.kl_penalty)
        kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=loss_agg_mode)
        loss = loss + spec.kl_coef * kl_loss
        terms["actor/kl_loss"] = kl_loss.detach()
    return MicroBatchLoss(loss, terms, {f"actor/{k}": v for k, v in pg_metrics.items()})


class ActorWorker(TrainedRole, MemoryReporting):
    """Trains the policy (PPO-family losses) and generates rollouts with it."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.rank = int(os.environ.get("RANK", "0"))
        self.ledger = MemoryLedger("actor", self.device, spec.memory_levers)

    @register(dispatch=Dispatch.ALL)
    def init_model(self, media_per_prompt: dict[str, int] | None = None) -> None:
        self.build_trainable(self.spec.model, self.device)
        with self.ledger.building_engine():  # its pools, kept apart from the training figures
            self.engine = build_rollout_engine(self.spec.rollout, self.device, media_per_prompt)
        self._engine_stale = False  # the engine loaded the same checkpoint the policy did
        self._session_open = False  # between open_rollout and close_rollout
        # Policy versions: `update_actor` calls the policy's weights reflect, and those of the weights the engine
        # holds (taken at each push). The initial checkpoint is version 0: step 1 samples with 0, step 2 with 1.
        self._policy_version = 0
        self._engine_version = 0

    # ---------------------------------------------------------------- rollout
    # An engine session: `open_rollout`, any number of `generate` calls, `close_rollout`. The driver drives the
    # lifecycle; `generate` itself never wakes, syncs or sleeps, so several calls share one wake and one push.
    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """One whole session around one `generate`: open, generate, close (the driver's synchronous loop). Returns
        the rows and the session's timings (`timing_s/wake`, `/update_weights`, `/generate_engine`, `/sleep`)."""
        timing = self.open_rollout()
        start = time.perf_counter()
        out = self.generate(prompts, params)
        timing["timing_s/generate_engine"] = time.perf_counter() - start
        timing |= self.close_rollout()
        return out, timing

    @register(dispatch=Dispatch.ALL)
    def open_rollout(self) -> dict[str, float]:
        """Move training state off the device (as `offload` says), wake the engine and, when the policy changed
        since the engine last held it, push the new weights. Returns `timing_s/wake` (and `timing_s/update_weights`
        after a push)."""
        if self._session_open:
            raise RuntimeError("open_rollout called twice: close the engine session (close_rollout) first")
        self._session_open = True
        return self._wake_engine()

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses for each of `prompts` (B rows in, B*n rows out) with the weights the engine
        holds; no wake, sync or sleep here (`open_rollout` / `close_rollout` around it). Each row carries the
        `policy_version` (B*n,) int64 of those weights: the `update_actor` calls they reflect.

        Each prompt's seed comes in the `sample_seed` column the driver made for its whole batch, so a prompt samples
        alike on whichever engine draws it (and the ranks of one tensor-parallel engine, given the same prompts, alike).
        """
        if not self._session_open:
            raise RuntimeError("generate outside an engine session: call open_rollout first (or generate_sequences)")
        assert SEED_COLUMN in prompts, f"the driver seeds every prompt of a generate call ({SEED_COLUMN!r} column)"
        out = self.engine.generate(prompts, params)
        # (B*n,) int64: which policy sampled each row (an off-policy consumer compares it with the trained one)
        return out.set(policy_version=torch.full((len(out),), self._engine_version, dtype=torch.int64))

    @register(dispatch=Dispatch.ALL)
    def set_policy_version(self, version: int) -> None:
        """A resumed run's policy version (`easyrl.trainer.step_math.resumed_policy_version`): the engine takes it
        at its next push, which a checkpoint load forces."""
        self._policy_version = version

    @register(dispatch=Dispatch.ALL)
    def close_rollout(self) -> dict[str, float]:
        """Put the engine to sleep and bring the training state back; returns `timing_s/sleep` (and, on CUDA,
        `perf/sleep_freed_gb`)."""
        if not self._session_open:
            raise RuntimeError("close_rollout without an open engine session: call open_rollout first")
        self.ledger.mark("after_generate")
        start = time.perf_counter()
        timing: dict[str, float] = {}
        self.ledger.sleep(self.engine)  # hands the allocator's cache back too
        self._engine_stale |= self.engine.discards_weights_on_sleep
        if self.ledger.slept_bytes is not None:  # what sleeping gave back to the device (weights + KV cache; CUDA)
            timing["perf/sleep_freed_gb"] = self.ledger.slept_bytes / 2**30
        self.trainable.reload()
        timing["timing_s/sleep"] = time.perf_counter() - start
        self._session_open = False
        return timing

    def _wake_engine(self) -> dict[str, float]:
        """Wake the engine; when the policy changed since it last generated, stream the new weights in
        between waking its weight memory and its KV cache (so both are never resident at once). Training state
        leaves the GPU (as `offload` says) while the engine holds it."""
        if not self._engine_stale:
            start = time.perf_counter()
            self.trainable.offload()
            self.ledger.wake(self.engine)  # hands the allocator's cache back first
            return {"timing_s/wake": time.perf_counter() - start}
        start = time.perf_counter()
        self.ledger.wake(self.engine, ["weights"])
        wake = time.perf_counter() - start
        start = time.perf_counter()
        self._push_weights()
        self._engine_version = self._policy_version  # a re-push after a level-2 sleep keeps the version
        update = time.perf_counter() - start
        start = time.perf_counter()
        self.trainable.offload()
        self.ledger.wake(self.engine, ["kv_cache"])
        wake += time.perf_counter() - start
        self._engine_stale = False
        return {"timing_s/wake": wake, "timing_s/update_weights": update}

    def _push_weights(self) -> None:
        """Send the policy's weights to the engine the way the driver chose (`spec.rollout.weight_sync`)."""
        sync = self.spec.rollout.weight_sync
        if (sync is WeightSync.FULL) == self.trainable.lora:
            raise RuntimeError(
                f"weight_sync={sync.value} for a {'LoRA' if self.trainable.lora else 'full'} policy: the actor spec "
                "was not built by easyrl.trainer.role_specs from this model's lora settings"
            )
        if sync is WeightSync.ADAPTER:
            self.engine.load_adapter(*self.trainable.lora_adapter())
        else:  # FULL and MERGED_LORA: `full_weights` merges the adapters in for a LoRA policy
            self.engine.load_weights(self.trainable.full_weights(self.engine.loads_tied_aliases))

    # ---------------------------------------------------------------- training
    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("old")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The policy's log-prob (B, R) and entropy (B, R) of each response token before the update."""
        self.model.eval()
        lp, ent = batched_log_probs(
            self.model,
            batch,
            self.device,
            self.spec.temperature,
            self.spec.micro_batch_size_for_experience,
            with_entropy=True,
            opts=self.spec.model.forward,
        )
        assert ent is not None
        return Batch({"old_log_probs": lp, "entropys": ent})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("ref")
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """LoRA: the reference log-prob (B, R) of each response token, from the base model under the adapters."""
        assert self.spec.serves_reference, "only a LoRA actor with KL on serves the reference log-probs"
        self.model.eval()
        with self.trainable.as_reference():
            lp, _ = batched_log_probs(
                self.model,
                batch,
                self.device,
                self.spec.temperature,
                self.spec.micro_batch_size_for_experience,
                opts=self.spec.model.forward,
            )
        return Batch({"ref_log_probs": lp})

    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("update")
    def update_actor(self, batch: Batch, entropy_coeff: float) -> dict[str, float]:
        """PPO-family update over the batch with the entropy bonus weighted by `entropy_coeff` (the driver's: fixed
        or adaptive; 0 turns the bonus and its entropy computation off); returns `actor/*` metrics (values over all
        ranks' rows, averaged over the mini-batches)."""
        self.model.train()
        if "old_log_probs" not in batch and (
            self.spec.update.epochs != 1 or len(batch) > self.spec.update.mini_batch_size
        ):
            # A second optimizer step would run moved weights: its "old" log-probs would not be the rollout policy's.
            raise ValueError(
                "update_actor without old_log_probs needs one epoch over one mini-batch "
                f"(worker.actor.ppo_epochs={self.spec.update.epochs}, {len(batch)} rows, mini-batch "
                f"{self.spec.update.mini_batch_size}): the driver's old-log-prob pass decision is out of step"
            )
        metrics = update_model(self.trainable, batch, self.spec.update, self._loss_fn(entropy_coeff), prefix="actor")
        if self.spec.loss.kl_in_loss:
            metrics["actor/kl_coef"] = self.spec.loss.kl_coef
        metrics |= self.trainable.state_sizes()
        self._policy_version += 1  # even when a non-finite step was skipped: versions count update calls
        self._engine_stale = True
        return metrics

    def _loss_fn(self, entropy_coeff: float) -> LossFn:
        """The policy loss of one micro-batch (plus the entropy bonus and the KL loss when they are on)."""
        opts, device, temperature = self.spec.model.forward, self.device, self.spec.temperature

        def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
            # the forward packs rows from the host copy; the loss reads the device copy only
            log_prob, entropy = token_log_probs(
                self.model, mb, device, temperature, with_entropy=entropy_coeff != 0, opts=opts
            )
            return policy_objective(
                on_device, log_prob, entropy, self.spec.loss, self.spec.update.loss_avg_mode, entropy_coeff
            )

        return loss_fn

    @register(dispatch=Dispatch.RANK0)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy as CPU tensors on rank 0 (every rank joins the gathers); for tests and small models."""
        weights = {name: t.cpu().clone() for name, t in self.trainable.full_weights(aliases=True)}
        return weights if self.rank == 0 else None
