"""The actor role: the FSDP2 policy being trained, with a `RolloutWorker` (its engine) in the same process
(HybridEngine).

After every update the policy's weights are streamed, a bucket of parameters at a time, into the engine in memory;
the engine sleeps while the policy trains and wakes for the next generation.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from easyrl.algorithms import agg_loss, kl_penalty, policy_loss_with_params, topk_forward_kl
from easyrl.algorithms.logprob_gap import LogprobGap, logprob_gap, scored_tokens
from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.distributed.memory import MemoryLedger, MemoryReporting, peak_memory
from easyrl.distributed.weight_bus import BusAddress, TensorEntry, WeightBus, manifest_of, sender_address
from easyrl.models.vl_embeds import embed_reuse_of
from easyrl.rollout.engine import SamplingParams
from easyrl.rollout.media_embeds import MediaEmbeds
from easyrl.rollout.worker import RolloutWorker
from easyrl.workers.forward_backward import (
    FirstForwardOld,
    LossFn,
    MicroBatchLoss,
    batched_log_probs,
    token_log_probs,
    update_model,
)
from easyrl.workers.head import token_log_probs_at
from easyrl.workers.model_setup import setup_process
from easyrl.workers.session import OneCallSession
from easyrl.workers.specs import ActorSpec, PolicyLossSpec
from easyrl.workers.trainable import TrainableModel, TrainedRole


logger = logging.getLogger(__name__)

ROLLOUT_ENTROPY = "actor/entropy_rollout"
"""The old-log-prob pass's entropy over the trained tokens, as the driver logs it from the pass (`data_metrics`); the
update reports it when it ran the pass itself (`worker.actor.reuse_first_forward`)."""


def _masked_sums(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `values` (b, R) over the 1s of `mask` (b, R), how many), float64: an exact-metric part
    (`MicroBatchLoss.ratios`). Masked positions are selected away, never multiplied by 0 (padding may hold NaN)."""
    keep = mask.bool()
    picked = torch.where(keep, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    return picked.sum(), keep.sum().to(torch.float64)


def policy_objective(
    mb: Batch,
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    spec: PolicyLossSpec,
    loss_agg_mode: str,
    entropy_coeff: float,
    topk_log_prob: torch.Tensor | None = None,
    policy_version: int | None = None,
) -> MicroBatchLoss:
    """The actor's objective over one micro-batch: the policy loss, minus the entropy bonus, plus the KL loss.

    `mb` is the micro-batch on the loss's device, and the only source of the per-token tensors used here (old and
    reference log-probs, advantages, mask, truncated IS weights), beside the current `log_prob` and `entropy` (b, R)
    from the forward pass: a tensor left on the host would fail on a GPU run. Without `old_log_probs` (the driver
    skipped the old-log-prob pass: one epoch over one mini-batch) they are `log_prob` detached: this forward runs
    the weights the pass would have run, so the ratio is 1 and the gradient the same. Whenever no pass runs (that
    case, and bypass mode: `spec.measures_engine`), the first mini-batch's forward runs the weights that sampled and
    measures the engine's log-probs (`rollout_log_probs`, when asked for) against them for free:
    `rollout/token_prob_error` and `rollout/logprob_diff_*`, as the driver does against the pass otherwise (`optimize`
    keeps the first mini-batch's figures only).
    `topk_log_prob` (b, R, k): the current log-probs at the teacher's top-k ids (`topk_fkl`), for the forward-KL term.
    `policy_version`: the version of the weights of this forward (with asynchronous rollouts the engine figures
    compare the tokens it sampled only).
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
        if entropy_coeff != 0:  # without the bonus the entropy is a metric only: the loss is the bonus-free one
            loss = loss - entropy_coeff * ent
        terms["actor/entropy"] = ent.detach()
    if spec.kl_in_loss:
        kl = kl_penalty(log_prob=log_prob, ref_log_prob=mb["ref_log_probs"], kl_penalty=spec.kl_penalty)
        kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=loss_agg_mode)
        loss = loss + spec.kl_coef * kl_loss
        terms["actor/kl_loss"] = kl_loss.detach()
    if spec.distill_topk_coef > 0:
        assert topk_log_prob is not None, "topk_fkl: the loss needs the student's log-probs at the teacher's top-k"
        fkl = topk_forward_kl(topk_log_prob, mb["teacher_topk_log_probs"])
        fkl_loss = agg_loss(loss_mat=fkl, loss_mask=mask, loss_agg_mode=loss_agg_mode)
        loss = loss + spec.distill_topk_coef * fkl_loss
        terms["actor/distill_topk_fkl"] = fkl_loss.detach()
    out = MicroBatchLoss(loss, terms, {f"actor/{k}": v for k, v in pg_metrics.items()})
    if old_log_prob is None:  # what this forward took as the old log-probs: mini-batch 1's, when the update keeps them
        out.own_old_log_prob = log_prob.detach()
    if spec.measures_engine and "rollout_log_probs" in mb:  # keys from the tensors present: alike on every rank
        gap = _engine_gap(mb, log_prob.detach(), policy_version)
        out.ratios, out.maxima = gap.ratios(), gap.maxima()
    return out


def _engine_gap(mb: Batch, log_prob: torch.Tensor, policy_version: int | None) -> LogprobGap:
    """The engine's log-probs of `mb` against the actor's `log_prob` (b, R) at the tokens both scored (sampled by the
    current policy version, where the engine reported them): `rollout/token_prob_error`, `rollout/logprob_diff_*`."""
    versions = mb.tensors.get("token_policy_version")
    scored = scored_tokens(mb["loss_mask"], mb.tensors.get("rollout_logprob_mask"), versions, policy_version)
    return logprob_gap(mb["rollout_log_probs"], log_prob, scored)


class ResidentPolicy:
    """The policy as the weight source of a rebuilt engine, mid-session: its shards come back to the device for the
    gathers (`offload` may have moved them off while the engine generates), and leave again after."""

    def __init__(self, trainable: TrainableModel) -> None:
        self.trainable = trainable
        self.lora = trainable.lora

    def full_weights(self, aliases: bool) -> Iterator[tuple[str, torch.Tensor]]:
        with self.trainable.resident(with_optimizer=False):
            yield from self.trainable.full_weights(aliases)

    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with self.trainable.resident(with_optimizer=False):
            return self.trainable.lora_adapter()


class ActorWorker(TrainedRole, MemoryReporting, OneCallSession):
    """Trains the policy (PPO-family losses) and generates rollouts with it."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec.process)
        self.rank = int(os.environ.get("RANK", "0"))
        self.ledger = MemoryLedger("actor", self.device, spec.memory_levers)

    @register(dispatch=Dispatch.ALL)
    def init_model(self, media_per_prompt: dict[str, int] | None = None) -> None:
        self.build_trainable(self.spec.model, self.device)
        # With separate placement the engines live in rollout workers of their own: this process only trains.
        self.rollout: RolloutWorker | None = None
        if self.spec.colocated_engine:
            # the engine takes the tower outputs this process holds (a frozen tower's) in place of their pixels
            reuse = embed_reuse_of(self.trainable.module)
            embeds = MediaEmbeds(reuse, "the policy has no vision-tower reuse") if media_per_prompt else None
            self.rollout = RolloutWorker(self.spec.rollout, self.device, self.ledger, media_per_prompt, embeds=embeds)
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                # A dead engine is rebuilt with weights this rank gathers alone; over several ranks the gathers are
                # collectives the other ranks are not in (they are generating): a rebuild there stops the run.
                self.rollout.rebuild_source = ResidentPolicy(self.trainable)
        # The policy's version: the `update_actor` calls its weights reflect. The initial checkpoint is version 0:
        # step 1 samples with 0, step 2 with 1; the engine takes the version with each push.
        self._policy_version = 0

    # ---------------------------------------------------------------- rollout
    # An engine session: `open_rollout`, any number of `generate` calls, `close_rollout`. The driver drives the
    # lifecycle (a `easyrl.rollout.RolloutLoop`); `generate` itself never wakes, syncs or sleeps, so several calls
    # share one wake and one push.
    @property
    def engine_session(self) -> RolloutWorker:
        if self.rollout is None:
            raise RuntimeError(
                "this actor has no rollout engine (worker.rollout.placement: separate): the rollout workers generate"
            )
        return self.rollout

    @register(dispatch=Dispatch.ALL_MERGED)
    def open_rollout(self) -> dict[str, float]:
        """Wake the engine and, when the policy changed since the engine last held it, push the new weights; the
        training state leaves the device (as `offload` says) before the engine's KV cache comes back. Returns
        `timing_s/wake` (and `timing_s/update_weights` after a push)."""
        return self.engine_session.open(self.trainable, self._policy_version, make_room=self.trainable.offload)

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses for each of `prompts` (B rows in, B*n rows out) with the weights the engine
        holds; no wake, sync or sleep here (`open_rollout` / `close_rollout` around it). Each row carries the
        `policy_version` (B*n,) int64 of those weights: the `update_actor` calls they reflect.

        Each prompt's seed comes in the `sample_seed` column the driver made for its whole batch, so a prompt samples
        alike on whichever engine draws it (and the ranks of one tensor-parallel engine, given the same prompts, alike).
        """
        return self.engine_session.generate(prompts, params)

    @register(dispatch=Dispatch.ALL)
    def set_policy_version(self, version: int) -> None:
        """A resumed run's policy version (`easyrl.trainer.step_math.resumed_policy_version`): the engine takes it
        at its next push, which a checkpoint load forces."""
        self._policy_version = version

    @register(dispatch=Dispatch.ALL_MERGED)
    def close_rollout(self) -> dict[str, float]:
        """Put the engine to sleep and bring the training state back; returns `timing_s/sleep` (both) and, on CUDA,
        `perf/sleep_freed_gb`."""
        timing = self.engine_session.close()
        start = time.perf_counter()
        self.trainable.reload()
        timing["timing_s/sleep"] += time.perf_counter() - start
        return timing

    def after_load_checkpoint(self) -> None:
        """The engine still holds the weights of before the load: push the restored ones at the next session."""
        if self.rollout is not None:
            self.rollout.stale = True

    @register(dispatch=Dispatch.RANK0)
    def policy_version(self) -> int:
        """The `update_actor` calls the policy's weights reflect (a driver pushing weights to rollout workers of
        their own compares it with the version they hold)."""
        return self._policy_version

    # ---------------------------------------------------------------- training
    @register(dispatch=Dispatch.DP_SPLIT)
    @peak_memory("old")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The policy's log-prob (B, R) and entropy (B, R) of each response token before the update."""
        lp, ent = self._forward_only_log_probs(batch)
        return Batch({"old_log_probs": lp, "entropys": ent})

    def _forward_only_log_probs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs and entropy (B, R) of `batch`, forward-only in the experience micro-batches: the
        old-log-prob pass, whether the driver calls it or the update runs it over the rows after its first
        mini-batch."""
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
        return lp, ent

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
        or adaptive; 0 turns the bonus off, the entropy then a detached metric); returns `actor/*` metrics (values
        over all ranks' rows, averaged over the mini-batches; `actor/entropy` always) and, without `old_log_probs`
        but with the engine's log-probs, the engine-vs-actor `rollout/token_prob_error` and `rollout/logprob_diff_*`
        (`policy_objective`). With `spec.old_from_first_forward` and no `old_log_probs`, it runs the old-log-prob pass
        over the rows after its first mini-batch itself (`timing_s/old_in_update`), mini-batch 1 taking its own first
        forward's, and reports what the driver would have measured against the pass: `actor/entropy_rollout` and the
        engine figures over every row."""
        reuse = self.spec.old_from_first_forward and "old_log_probs" not in batch
        if (
            not reuse
            and "old_log_probs" not in batch
            and (self.spec.update.epochs != 1 or len(batch) > self.spec.update.mini_batch_size)
        ):
            # A second optimizer step would run moved weights: its "old" log-probs would not be the rollout policy's.
            raise ValueError(
                "update_actor without old_log_probs needs one epoch over one mini-batch "
                f"(worker.actor.ppo_epochs={self.spec.update.epochs}, {len(batch)} rows, mini-batch "
                f"{self.spec.update.mini_batch_size}): the driver's old-log-prob pass decision is out of step"
            )
        start = time.perf_counter()
        first_forward_old = self._old_after_first_mini_batch(batch) if reuse else None
        metrics = {"timing_s/old_in_update": time.perf_counter() - start} if reuse else {}
        self.model.train()
        fn = self._loss_fn(entropy_coeff, rollout_entropy=reuse)
        metrics |= update_model(self.trainable, batch, self.spec.update, fn, "actor", first_forward_old)
        if self.spec.loss.kl_in_loss:
            metrics["actor/kl_coef"] = self.spec.loss.kl_coef
        metrics |= self.trainable.state_sizes()
        metrics |= self.trainable.vision_counts()  # this step's passes: old log-probs (and reference), update
        self._policy_version += 1  # even when a non-finite step was skipped: versions count update calls
        if self.rollout is not None:
            self.rollout.stale = True
        return metrics

    def _old_after_first_mini_batch(self, batch: Batch) -> FirstForwardOld:
        """The old-log-prob pass over this rank's rows after its first mini-batch (`worker.actor.reuse_first_forward`),
        forward-only with the weights before the update, as `compute_log_probs` runs it; with those rows' parts of
        what the driver measures against a whole pass: the rollout entropy and the engine-vs-actor figures."""
        rest = batch.slice(self.spec.update.mini_batch_size, len(batch))
        # One mini-batch over several epochs: the first forward gives every row (the same on all ranks).
        if len(rest) == 0:
            return FirstForwardOld(batch["loss_mask"].new_zeros((0, batch["loss_mask"].shape[1]), dtype=torch.float32))
        lp, ent = self._forward_only_log_probs(rest)
        ratios = {ROLLOUT_ENTROPY: torch.stack(_masked_sums(ent, rest["loss_mask"]))}
        maxima: dict[str, torch.Tensor] = {}
        if self.spec.loss.measures_engine and "rollout_log_probs" in rest:  # tensors present: alike on every rank
            gap = _engine_gap(rest, lp, self._policy_version)
            ratios |= {k: torch.stack(pair) for k, pair in gap.ratios().items()}
            maxima = gap.maxima()
        return FirstForwardOld(lp, ratios, maxima)

    def _loss_fn(self, entropy_coeff: float, rollout_entropy: bool = False) -> LossFn:
        """The policy loss of one micro-batch (plus the entropy bonus and the KL loss when they are on).
        `rollout_entropy`: a micro-batch without old log-probs (mini-batch 1's, taken from this forward) adds its part
        of the entropy an old-log-prob pass would have given (`actor/entropy_rollout`)."""
        opts, device, temperature = self.spec.model.forward, self.device, self.spec.temperature

        def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
            # the forward packs rows from the host copy; the loss reads the device copy only
            # The entropy always comes (`actor/entropy`, whether or not an old-log-prob pass ran); without the bonus
            # it is computed from this forward with no graph, so the loss and its gradient are the bonus-free ones.
            grad, at = entropy_coeff != 0, None
            if self.spec.loss.distill_topk_coef > 0:  # one forward gives both: the sampled tokens and the top-k ids
                log_prob, entropy, at = token_log_probs_at(
                    self.model, mb, device, temperature, mb["teacher_topk_ids"], True, opts, entropy_grad=grad
                )
            else:
                log_prob, entropy = token_log_probs(
                    self.model, mb, device, temperature, True, opts=opts, entropy_grad=grad
                )
            out = policy_objective(
                on_device, log_prob, entropy, self.spec.loss, self.spec.update.loss_avg_mode, entropy_coeff, at,
                self._policy_version,
            )  # fmt: skip
            if rollout_entropy and "old_log_probs" not in mb:
                assert entropy is not None  # the actor's forward always gives it
                out.ratios[ROLLOUT_ENTROPY] = _masked_sums(entropy.detach(), on_device["loss_mask"])
            return out

        return loss_fn

    @register(dispatch=Dispatch.RANK0)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy as CPU tensors on rank 0 (every rank joins the gathers); for tests and small models."""
        weights = {name: t.cpu().clone() for name, t in self.trainable.full_weights(aliases=True)}
        return weights if self.rank == 0 else None

    # ---------------------------------------------------------------- weights to rollout workers of their own
    # `worker.rollout.weight_transfer: broadcast`: rank 0 broadcasts each full tensor to the rollout workers over a
    # group of their own (easyrl.distributed.weight_bus); the other ranks only join the gathers.
    @register(dispatch=Dispatch.RANK0)
    def weight_manifest(self) -> list[TensorEntry]:
        """The names, shapes and dtypes the broadcasts will carry (one gather of the whole policy; every rank joins)."""
        manifest = manifest_of(list(self.trainable.full_weights(aliases=True)))
        return manifest if self.rank == 0 else []

    @register(dispatch=Dispatch.RANK0)
    def weight_bus_address(self, world_size: int) -> BusAddress:
        """Rank 0's host and a port free there: where the bus's rendezvous will listen."""
        return sender_address(world_size)

    @register(dispatch=Dispatch.ALL)
    def join_weight_bus(self, address: BusAddress) -> None:
        """Rank 0 joins the bus as its sender (returns once every rollout worker has joined too)."""
        if self.rank == 0:
            self._bus = WeightBus(address, 0, self.device)

    @register(dispatch=Dispatch.ALL)
    def broadcast_weights(self) -> None:
        """Send the policy's full weights to every rollout worker, one tensor at a time: no whole copy anywhere on
        this side (each gathered tensor is freed once sent). The receivers run `receive_broadcast` meanwhile."""
        for _, tensor in self.trainable.full_weights(aliases=True):
            if self.rank == 0:
                self._bus.send(tensor)
