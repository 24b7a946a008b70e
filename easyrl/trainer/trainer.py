"""The single controller: builds the workers on Ray and runs the RL loop. `fit()` reads as the algorithm."""

from __future__ import annotations

import logging
from typing import Any

import torch

from easyrl.algorithms import AdaptiveEntropyController, get_kl_controller
from easyrl.batch import Batch
from easyrl.config import EasyRLConfig, Secrets
from easyrl.config.algorithm import KLMode
from easyrl.rollout import RolloutLoop
from easyrl.rollout.loop import Scored
from easyrl.seeding import GREEDY_STREAM, VALIDATION_STREAM, derive_seed
from easyrl.trainer.plan import plan_of
from easyrl.trainer.resolve import one_session_loop, rollout_loop
from easyrl.trainer.reward_inputs import reward_inputs_for, validation_samples_for
from easyrl.trainer.role_specs import sampling_params, validation_sampling
from easyrl.trainer.run import RunFolder, StopRequested, TrainingError
from easyrl.trainer.step_math import (
    apply_distillation,
    apply_kl_in_reward,
    apply_rollout_correction,
    compute_advantages,
    data_metrics,
    first_nonfinite,
    keep_informative_groups,
    mean_entropy,
    mini_batch_major_order,
    policy_version_metrics,
    pool_reward_metrics,
    resumed_policy_version,
    sampled_validation_metrics,
    throughput_metrics,
    token_level_scores,
)
from easyrl.trainer.timer import timer
from easyrl.trainer.worker_groups import build_data, build_workers, count_steps


__all__ = ["StopRequested", "Trainer", "TrainingError", "for_workers"]

logger = logging.getLogger(__name__)


class Trainer(RunFolder):
    def __init__(self, cfg: EasyRLConfig, secrets: Secrets) -> None:
        from easyrl.rewards import RewardManager

        self.cfg = cfg
        self.plan = plan_of(cfg)  # decided once: the role specs, the loops and `fit()` read it
        self.tokenizer, self.train_data, self.val_data, self.sampler = build_data(cfg)
        self.total_steps, self.optimizer_steps = count_steps(cfg, self.sampler.steps_per_epoch)
        self.sampling = sampling_params(cfg, self.plan)
        self.val_sampling = validation_sampling(cfg, self.plan)
        self.reward_inputs = reward_inputs_for(
            self.plan.modality, self.tokenizer, cfg.worker.reward.skip_special_tokens
        )
        self.keep_val_samples = validation_samples_for(self.plan.modality, cfg.trainer.save_checkpoint_path)
        # how prompts become rows (a RolloutLoop); validation and greedy baselines always take one session per call
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # the loop owns its work in flight: state, settling, and (asynchronous) the groups it scored early
        self.rollout_loop = rollout_loop(cfg, self.plan, self.next_prompts, tok.eos_token_id, pad, self.score_rows)
        self.one_session = one_session_loop(cfg, self.plan, self.rollout_loop)  # validation and greedy baselines
        # off: the update takes its own forward's log-probs, detached (and runs the pass itself after mini-batch 1)
        self.old_pass = self.plan.old_log_prob_pass.before_update
        self.needs = self.plan.needs
        self.rollout_seed = cfg.worker.rollout.seed
        alg = cfg.algorithm
        self.kl_ctrl = get_kl_controller(alg.kl_type, alg.kl_coef, alg.kl_target, alg.kl_horizon)
        self.entropy_ctrl = (
            AdaptiveEntropyController(
                alg.entropy_init_coef,
                alg.entropy_target,
                alg.entropy_delta,
                alg.entropy_min_coef,
                alg.entropy_max_coef,
            )
            if alg.adaptive_entropy
            else None
        )
        self.global_step = 0
        self.prompts_drawn = 0  # numbers group ids; part of the resumable state
        self.stop_signal: str | None = None  # set by a SIGTERM/SIGINT/SIGHUP handler; honoured between stages
        self.consecutive_skips = 0
        try:
            resume_from = self.open_run(cfg, secrets)  # the lock, the checkpoint to resume, the loggers
            if self.trained_to is not None:
                return  # trained to the end already: no reward processes, no Ray, no workers to start
            local_judge = cfg.worker.reward.judge.model.local
            if not local_judge:  # first: a reward that cannot load stops the run before any worker starts
                self.reward = RewardManager(cfg.worker.reward)
            self.workers = build_workers(cfg, self.plan, self.optimizer_steps, self.train_data, self.val_data)
            if local_judge:  # its server runs beside the workers (Ray places it); the reward workers call it
                self.reward = RewardManager(self.workers.serve_judge(cfg.worker.reward))
            self.actor, self.ref, self.critic = self.workers.actor, self.workers.ref_source, self.workers.critic
            self.teacher = self.workers.teacher
            if resume_from is not None:
                self.resume(resume_from)
        except BaseException:
            self.close()  # release whatever started (processes, workers, the placement group)
            raise

    # ------------------------------------------------------------------ the algorithm
    def fit(self) -> dict[str, float]:
        """Run training to `total_steps`; returns the last step's metrics."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        if self.trained_to is not None:
            self.log_already_trained()
            return metrics
        # a resumed run validated (or not) at its checkpoint's step already: validating again would add a row the
        # uninterrupted run does not have
        if (cfg.trainer.val_before_train and self.global_step == 0) or cfg.trainer.val_only:
            val = self.validate()
            self.tracker.log_metrics(val, self.global_step)
            if cfg.trainer.val_only:
                return val
        while self.global_step < self.total_steps and self.stop_signal is None:
            step_start = self.trainer_state()
            self.global_step += 1
            timings: dict[str, float] = {}
            metrics = {}
            with timer("step", timings):
                batch, gen_metrics = self.rollout_with_rewards(timings)
                metrics |= gen_metrics
                if self.stop_signal is not None:  # asked to stop before anything trained: undo this step
                    self.restore_driver_state(step_start)
                    break
                if self.old_pass:
                    with timer("old", timings):
                        batch = batch.union(self.actor.compute_log_probs(for_workers(batch)))
                if self.ref is not None:
                    with timer("ref", timings):
                        batch = batch.union(self.ref.compute_ref_log_probs(for_workers(batch)))
                if self.teacher is not None:
                    with timer("teacher", timings):
                        batch = batch.union(self.teacher.compute_teacher_log_probs(for_workers(batch)))
                if self.critic is not None:
                    with timer("values", timings):
                        batch = batch.union(self.critic.compute_values(for_workers(batch)))
                with timer("adv", timings):
                    metrics |= self.compute_rewards_and_advantages(batch)
                    bad = first_nonfinite(
                        batch, ("token_level_scores", "token_level_rewards", "advantages", "returns")
                    )
                if self.critic is not None and bad is None:
                    with timer("update_critic", timings):
                        metrics |= self.critic.update_critic(self.for_update(batch, "critic"))
                if bad is not None:  # never let a non-finite value reach an optimizer
                    metrics |= {"actor/skipped_updates": 1.0, f"training/nonfinite/{bad}": 1.0}
                    self.check_skipped_updates(metrics, culprit=bad)
                elif self.global_step > cfg.trainer.critic_warmup:
                    with timer("update_actor", timings):
                        metrics |= self.actor.update_actor(self.for_update(batch, "actor"), self.entropy_coeff())
                    self.check_skipped_updates(metrics)
            metrics |= data_metrics(batch, cfg.data.max_prompt_length, cfg.data.max_response_length)
            metrics |= policy_version_metrics(batch)
            metrics |= {f"timing_s/{k}": v for k, v in timings.items()}
            metrics |= throughput_metrics(batch, timings, self.workers.world_size)
            metrics |= self.workers.memory_metrics()
            if self.should_validate():
                metrics |= self.validate()
            if self.should_save():
                with timer("save", timings):
                    self.save_checkpoint(metrics.get("val/reward_score"))
                metrics["timing_s/save"] = timings["save"]
            self.tracker.log_metrics(metrics, self.global_step)
        if self.stop_signal is not None:
            self.stop_cleanly()
        return metrics

    # ------------------------------------------------------------------ stages
    def rollout_with_rewards(self, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Sample prompts, generate `n` responses each, score them; with online filtering, keep only
        informative groups and sample again until the batch is full."""
        cfg, alg = self.cfg, self.cfg.algorithm
        want = cfg.data.rollout_batch_size
        per_try = (cfg.data.mini_rollout_batch_size or want) if alg.online_filtering else want
        kept: list[Batch] = []
        kept_prompts, tries = 0, 0
        metrics: dict[str, float] = {}
        scored: list[tuple[dict[str, float], int]] = []  # reward metrics of every try
        while kept_prompts < want:
            tries += 1
            if alg.online_filtering and 0 < alg.max_try_make_batch < tries:
                raise TrainingError(
                    f"online filtering kept {kept_prompts}/{want} prompts after {alg.max_try_make_batch} tries "
                    f"(algorithm.max_try_make_batch): widen algorithm.filter_low/filter_high or raise the budget"
                )
            prompts = self.next_prompts(per_try)
            with timer("gen", timings):
                batch = self.generate(prompts, derive_seed(self.global_step, tries, "attempt"), metrics)
                if self.needs.needs_greedy_baseline:
                    batch.set(reward_baselines=self.greedy_baselines(prompts, tries))
            with timer("reward", timings):
                scores, reward_metrics = self.score(batch)
            if not alg.online_filtering:
                return batch, {**metrics, **reward_metrics}
            scored.append((reward_metrics, len(scores)))
            keep = keep_informative_groups(
                batch["uid"], [s[alg.filter_key] for s in scores], alg.filter_low, alg.filter_high
            )
            if keep:
                kept.append(batch.index(keep))
                kept_prompts += len(keep) // cfg.worker.rollout.n
        batch = Batch.concat(kept).slice(0, want * cfg.worker.rollout.n)
        metrics |= pool_reward_metrics(scored)  # over all samples generated this step, filtered out or kept
        metrics["batch/num_gen_batches"] = float(tries)
        return batch, metrics

    def generate(
        self,
        prompts: Batch,
        seed: int,
        metrics: dict[str, float],
        overrides: dict | None = None,
        loop: RolloutLoop | None = None,
    ) -> Batch:
        """`n` responses for each of `prompts` (`n` and the rest of the sampling from `worker.rollout`, changed by
        `overrides`): the rollout loop (the training one unless `loop` is given) returns the B*n rows, sample `j` of
        prompt `i` at `i*n + j`."""
        params = self.sampling.override({**(overrides or {}), "seed": derive_seed(self.rollout_seed, seed, "call")})
        batch, timing = (loop or self.rollout_loop).run(self.workers.engines, prompts, params)
        metrics |= timing
        return batch

    def greedy_baselines(self, prompts: Batch, tries: int) -> torch.Tensor:
        """ReMax: the score of the greedy response to each prompt, repeated for its `n` samples."""
        seed = derive_seed(GREEDY_STREAM, tries, "attempt")
        greedy = self.generate(prompts, seed, {}, {"temperature": 0.0, "n": 1, "logprobs": False}, self.one_session)
        scores, _ = self.score(greedy, store=False)
        return torch.tensor([s["overall"] for s in scores]).repeat_interleave(self.cfg.worker.rollout.n)

    def score(self, batch: Batch, store: bool = True) -> tuple[list[dict[str, float]], dict[str, float]]:
        """Run the reward function on decoded responses; fills `token_level_scores` (B, R) when `store`. The rollout
        loop decides how (an asynchronous one hands back the scores of groups it scored as they finished)."""
        scores, metrics, texts = self.rollout_loop.score(batch, self.score_rows)
        if store:
            batch.set(token_level_scores=token_level_scores([s["overall"] for s in scores], batch["loss_mask"]))
            batch.set(response_text=texts)
        return scores, metrics

    def score_rows(self, batch: Batch) -> Scored:
        """The reward function's inputs for the rows (decoded responses, or images: `reward_inputs`) and its call:
        per-sample scores, the manager's metrics, the texts."""
        inputs, texts = self.reward_inputs(batch)
        scores, metrics = self.reward.score(inputs)
        return scores, metrics, texts

    def compute_rewards_and_advantages(self, batch: Batch) -> dict[str, float]:
        alg = self.cfg.algorithm
        # First: bypass mode sets the old log-probs and rejection edits the loss mask, which everything below reads.
        # the version of the weights the old-log-prob pass ran: the engine figures compare what those weights sampled
        version = resumed_policy_version(self.global_step - 1, self.cfg.trainer.critic_warmup)
        metrics = apply_rollout_correction(batch, alg.correction, version)
        if alg.kl_mode == KLMode.IN_REWARD:
            metrics |= apply_kl_in_reward(batch, self.kl_ctrl, alg.kl_penalty)
        else:
            batch.set(token_level_rewards=batch["token_level_scores"])
        if not alg.distill.enabled or alg.distill.with_task_reward:  # pure distillation has no task advantage
            compute_advantages(batch, alg)
        if alg.distill.enabled:  # the teacher's per-token penalty on top of the task advantage
            metrics |= apply_distillation(batch, alg.distill) | self.workers.teacher_call_metrics()
        if self.entropy_ctrl is not None:  # it forces the old-log-prob pass, which brings the entropy
            self.entropy_ctrl.update(mean_entropy(batch))
        metrics["actor/entropy_coeff"] = self.entropy_coeff()
        return metrics

    def entropy_coeff(self) -> float:
        """The entropy bonus weight of this step's update: the adaptive controller's (updated from this step's
        rollout), else `algorithm.entropy_coeff`."""
        return self.entropy_ctrl.value if self.entropy_ctrl is not None else self.cfg.algorithm.entropy_coeff

    def for_update(self, batch: Batch, role: str) -> Batch:
        """`for_workers` with the rows in `mini_batch_major_order`: the role's optimizer steps see the same global
        mini-batches whatever its data-parallel size."""
        group = getattr(self, role)
        rows = getattr(self.cfg.worker, role).global_batch_size * self.cfg.worker.rollout.n
        dp = group.world_size // group.ranks_per_dp
        return for_workers(batch).index(mini_batch_major_order(len(batch), rows, dp))

    def check_skipped_updates(self, metrics: dict[str, float], culprit: str | None = None) -> None:
        """Count updates skipped for non-finite values; too many in a row stops the run."""
        skipped = metrics.get("actor/skipped_updates", 0.0)
        self.consecutive_skips = self.consecutive_skips + 1 if skipped > 0 else 0
        metrics["actor/consecutive_skips"] = float(self.consecutive_skips)
        if skipped > 0:
            if culprit is None:
                culprit = "actor loss" if metrics.get("actor/nonfinite_loss", 0.0) > 0 else "actor/grad_norm"
            logger.warning("step %d: update skipped for a non-finite %s", self.global_step, culprit)
        limit = self.cfg.worker.actor.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise TrainingError(
                f"step {self.global_step}: {self.consecutive_skips} consecutive actor updates skipped for "
                f"non-finite values (first non-finite: {culprit}); see worker.actor.max_consecutive_skips"
            )

    def should_validate(self) -> bool:
        freq = self.cfg.trainer.val_freq
        last = self.global_step == self.total_steps
        return self.val_data is not None and ((freq > 0 and self.global_step % freq == 0) or (last and freq > 0))

    def validate(self) -> dict[str, float]:
        """Generate for the whole validation set with `val_override_config`; mean scores as `val/*`, and with `n`
        samples per prompt their per-prompt mean, best and pass rate (`sampled_validation_metrics`)."""
        if self.val_data is None:
            return {}
        from easyrl.data import collate_prompts

        overrides = {**self.val_sampling, **self.cfg.worker.rollout.val_override_config}
        size = self.cfg.data.val_batch_size if self.cfg.data.val_batch_size > 0 else len(self.val_data)
        all_scores: list[dict[str, float]] = []
        generations: list[dict[str, Any]] = []
        reward_errors = 0.0  # samples whose reward call raised, timed out or returned an invalid value
        for start in range(0, len(self.val_data), size):
            items = [self.val_data[i] for i in range(start, min(start + size, len(self.val_data)))]
            prompts = self.workers.pad_for_dp(
                _as_batch(collate_prompts(items, self.tokenizer.pad_token_id, self.cfg.data.max_prompt_length))
            )
            seed = derive_seed(VALIDATION_STREAM, start, "attempt")
            batch = self.generate(prompts.batch, seed, {}, overrides, self.one_session)
            batch = batch.slice(0, prompts.real * int(overrides.get("n", 1)))
            if self.keep_val_samples is not None:  # images beside the run (the report's grids)
                self.keep_val_samples(batch, self.global_step, start, int(overrides.get("n", 1)))
            scores, reward_metrics = self.score(batch)
            reward_errors += sum(reward_metrics[k] for k in ("reward/errors", "reward/timeouts", "reward/invalid"))
            all_scores += scores
            generations += [
                {"prompt": p, "response": r, "ground_truth": g, "score": s["overall"]}
                for p, r, g, s in zip(batch["raw_prompt"], batch["response_text"], batch["ground_truth"], scores)
            ]
        keys = sorted({k for s in all_scores for k in s})
        metrics = {f"val/reward/{k}": sum(s.get(k, 0.0) for s in all_scores) / len(all_scores) for k in keys}
        metrics |= sampled_validation_metrics(all_scores, int(overrides.get("n", 1)))
        metrics["val/reward_score"] = metrics.get("val/reward/overall", float("nan"))
        metrics["val/reward_errors"] = reward_errors
        if self.cfg.trainer.val_generations_to_log > 0:
            self.tracker.log_generations(generations[: self.cfg.trainer.val_generations_to_log], self.global_step)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        """Everything of the driver a resumed run needs to continue on the same curve (JSON-able): with a rollout
        loop that keeps work in flight across steps, that work too (`rollout_loop`)."""
        state = {
            "global_step": self.global_step,
            "prompts_drawn": self.prompts_drawn,
            "consecutive_skips": self.consecutive_skips,
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "entropy_ctrl": self.entropy_ctrl.state_dict() if self.entropy_ctrl is not None else None,
        }
        in_flight = self.rollout_loop.state_dict()
        if in_flight:
            state["rollout_loop"] = in_flight
        return state

    def save_checkpoint(self, val_score: float | None) -> None:
        """With a call generating beside the update (separate rollout workers, S >= 1), collect it first: the
        checkpoint then holds its tokens and a resumed run continues them to the bit."""
        self.rollout_loop.settle()
        super().save_checkpoint(val_score)

    def request_stop(self, signal_name: str) -> None:
        """Stop at the next stage boundary (a step that has not trained yet is undone), saving first when
        `trainer.save_on_interrupt` is set; `fit()` then raises `StopRequested`. A reward stage in progress returns
        at once (its batch is discarded with the unfinished step)."""
        super().request_stop(signal_name)
        if hasattr(self, "reward"):
            self.reward.interrupt()

    def restore_driver_state(self, state: dict[str, Any]) -> None:
        """Put the driver back to `state` (from `trainer_state()`): used to undo an unfinished step."""
        self.global_step = state["global_step"]
        self.prompts_drawn = state["prompts_drawn"]
        self.consecutive_skips = state["consecutive_skips"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.entropy_ctrl is not None and state.get("entropy_ctrl"):
            self.entropy_ctrl.load_state_dict(state["entropy_ctrl"])
        self.rollout_loop.load_state_dict(state.get("rollout_loop") or {})

    def after_resume(self) -> None:
        """The policy version of the resumed weights (checkpoints do not record it)."""
        self.actor.set_policy_version(resumed_policy_version(self.global_step, self.cfg.trainer.critic_warmup))

    def trained_groups(self) -> list[tuple[str, Any]]:
        groups = [("actor", self.actor)]
        return groups + ([("critic", self.critic)] if self.critic is not None else [])

    def next_prompts(self, num: int) -> Batch:
        """The next `num` prompts from the resumable sampler, each with a fresh group id."""
        from easyrl.data import collate_prompts

        indices: list[int] = []
        while len(indices) < num:
            indices += self.sampler.next_indices()
        items = [self.train_data[i] for i in indices[:num]]
        batch = _as_batch(collate_prompts(items, self.tokenizer.pad_token_id, self.cfg.data.max_prompt_length))
        first = self.prompts_drawn
        self.prompts_drawn += num
        return batch.set(uid=[f"p{first + j}" for j in range(num)])

    def close(self) -> None:
        """Release everything this trainer started; safe on a partly built trainer."""
        for name in ("rollout_loop", "reward"):  # the loop's background scorer first: it calls into the reward pool
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        super().close()  # the loggers, the workers, the run folder's lock


def for_workers(batch: Batch, *extra: str) -> Batch:
    """What the workers read: the tensors and per-sample media (processed pixels), plus the `extra`
    fields. Rows, prompt texts and decoded responses stay in the driver instead of being serialized to every
    worker on every call."""
    return batch.select(*batch.tensors, "multi_modal_inputs", *extra)


def _as_batch(collated: dict[str, Any]) -> Batch:
    tensors = {k: v for k, v in collated.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in collated.items() if not isinstance(v, torch.Tensor)}
    return Batch(tensors, others)
