"""The trainer's per-step computations on a `Batch`, kept free of workers and I/O so they read (and test) alone."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from enum import Enum

import torch

from easyrl.algorithms import (
    KLController,
    agg_loss,
    distill_advantages,
    get_advantage_estimator,
    kl_penalty,
    masked_mean,
)
from easyrl.algorithms.logprob_gap import logprob_gap, scored_tokens
from easyrl.algorithms.rollout_correction import correct_rollout
from easyrl.batch import Batch
from easyrl.config import AlgorithmConfig, DistillConfig, RolloutCorrectionConfig


def token_level_scores(scores: Sequence[float], loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last trained response token (the last 1 of `loss_mask` (B, R), the first
    column for a row with none): (B, R)."""
    out = torch.zeros_like(loss_mask, dtype=torch.float32)
    # The last 1, not the count of 1s: a multi-turn row's loss mask has holes (tool output) before its end.
    columns = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    last = torch.where(loss_mask.bool(), columns, -1).max(dim=1).values.clamp(min=0)
    for i, (score, column) in enumerate(zip(scores, last.tolist())):
        out[i, column] = float(score)
    return out


def apply_kl_in_reward(batch: Batch, controller: KLController, kind: str) -> dict[str, float]:
    """token_level_rewards = scores - beta * KL(old || ref) per token; updates the controller."""
    mask = batch["loss_mask"].float()
    kl = kl_penalty(log_prob=batch["old_log_probs"], ref_log_prob=batch["ref_log_probs"], kl_penalty=kind) * mask
    beta = controller.value
    batch.set(token_level_rewards=batch["token_level_scores"] - beta * kl)
    # The controller's KL as verl measures it: each sequence's token mean, averaged over the sequences with a token.
    current = float(agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode="seq-mean-token-mean"))
    controller.update(current_kl=current, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> None:
    """Fill `advantages` and `returns` (B, R) with the configured estimator."""
    estimator = get_advantage_estimator(cfg.adv_estimator)
    extra: dict[str, object] = {"gamma": cfg.gamma, "lam": cfg.lam, "norm_adv_by_std": cfg.norm_adv_by_std_in_grpo}
    if "values" in batch:
        extra["values"] = batch["values"]
    if "reward_baselines" in batch:
        extra["reward_baselines"] = batch["reward_baselines"]
    adv, ret = estimator(
        token_level_rewards=batch["token_level_rewards"],
        # The estimators keep verl's keyword; what they get is the loss mask (tool output neither earns nor passes reward).
        response_mask=batch["loss_mask"].float(),
        index=batch["uid"],
        **extra,
    )
    batch.set(advantages=adv, returns=ret)


def apply_distillation(batch: Batch, cfg: DistillConfig) -> dict[str, float]:
    """On-policy distillation, after the task advantages: `advantages` (B, R) less `coef` times the teacher's
    per-token penalty on the student's sampled tokens (without the task reward, the penalty alone). The student's
    log-probs are those of the policy that sampled (`old_log_probs`: the pass, or the engine's in bypass mode).
    `topk_fkl` leaves the advantages to the task (0 without it): its signal is a loss term of the actor's."""
    mask = batch["loss_mask"].float()
    task = batch["advantages"] if cfg.with_task_reward else torch.zeros_like(mask)
    student, teacher = batch["old_log_probs"], batch["teacher_log_probs"]
    extra: dict[str, float] = {}
    if cfg.mode == "topk_fkl":
        adv, penalty = task * mask, torch.zeros_like(mask)
        # How much of the teacher's distribution its top k hold: the forward KL leaves the rest out.
        extra["distill/teacher_topk_mass"] = float(masked_mean(batch["teacher_topk_log_probs"].exp().sum(-1), mask))
    else:
        adv, penalty = distill_advantages(task, student, teacher, mask, cfg.coef, cfg.mode)
    batch.set(advantages=adv)
    if not cfg.with_task_reward:
        batch.set(returns=adv)  # nothing else is returned: the teacher's signal is the whole return
    # The reverse KL (k1) is logged whatever the mode: it is what distillation drives to 0.
    return {
        "distill/reverse_kl": float(masked_mean(student - teacher, mask)),
        "distill/penalty": float(masked_mean(penalty, mask)),
        "distill/teacher_log_prob": float(masked_mean(teacher, mask)),
        "distill/coef": cfg.coef,
        **extra,
    }


def keep_informative_groups(uids: Sequence[Hashable], scores: Sequence[float], low: float, high: float) -> list[int]:
    """DAPO dynamic sampling: indices of samples whose group's mean score lies strictly in (low, high).

    A group whose samples all score the same (all right or all wrong) has zero advantage under group
    baselines and teaches nothing; the bounds drop those groups.
    """
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, uid in enumerate(uids):
        groups[uid].append(i)
    keep = []
    for members in groups.values():
        mean = sum(scores[i] for i in members) / len(members)
        if low < mean < high:
            keep.extend(members)
    return sorted(keep)


REWARD_COUNTERS = ("reward/errors", "reward/timeouts", "reward/invalid", "reward/retried_chunks")
"""Reward metrics that count events (summed across sampling tries); the others are per-sample means."""


def pool_reward_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The reward metrics of several scored batches (each ``(metrics, number of samples)``) as if scored at once:
    counters summed, means weighted by sample count. Online filtering reports every sample generated this step."""
    pooled: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics, _ in parts for k in metrics):  # every key of any part, first-seen order
        if key in REWARD_COUNTERS:
            pooled[key] = sum(metrics.get(key, 0.0) for metrics, _ in parts)
        else:
            having = [(metrics[key], n) for metrics, n in parts if key in metrics]
            pooled[key] = sum(v * n for v, n in having) / max(1, sum(n for _, n in having))
    return pooled


class OldPass(str, Enum):
    """Which rows the actor's forward-only old-log-prob pass runs over in a step (`old_pass_rows`)."""

    ALL_ROWS = "all_rows"
    """Every row, in a call of its own before anything reads the old log-probs (the driver's `old` stage)."""
    AFTER_FIRST_MINI_BATCH = "after_first_mini_batch"
    """Inside the update call, before its first optimizer step, every row but the worker's first mini-batch: that
    mini-batch's old log-probs are its own first forward's, detached (the weights have not moved yet)."""
    NONE = "none"
    """No pass: one epoch over one mini-batch takes its forward's log-probs, or bypass mode the engine's."""

    @property
    def before_update(self) -> bool:
        """The driver runs the pass before the update (the old log-probs and the entropy are in its batch)."""
        return self is OldPass.ALL_ROWS

    def __bool__(self) -> bool:
        # This was a bool ("runs the pass"); as a str every member would be truthy and `if plan.old_log_prob_pass:`
        # would silently always run it. Ask the question by name instead.
        raise TypeError("OldPass has three values: test `.before_update` or compare with a member, not its truth")


def old_pass_rows(
    *,
    distill: bool = False,
    ppo_epochs: int,
    mini_batches: int,
    kl_in_reward: bool,
    correction: bool,
    adaptive_entropy: bool,
    bypass: bool,
    reuse_first_forward: bool = False,
) -> OldPass:
    """Which rows a step's old-log-prob pass runs over (TRL skips the pass when it may).

    With one epoch over one mini-batch the update's only forward pass runs the very weights the old pass would:
    the old log-probs are the current ones, detached (ratio 1, same gradient), and the loss can take them from that
    forward. The pass is still needed when something reads them (or the entropy it returns) before the update: KL in
    the reward, a rollout correction (importance weights, rejection, veto), the adaptive entropy controller, or
    on-policy distillation (the student's log-probs against the teacher's, in the advantages). The engine-vs-actor
    figures (`rollout/token_prob_error`, `rollout/logprob_diff_*`) need no pass: that same forward measures them.
    Bypass mode never runs it: the engine's log-probs are the old ones (config validation refuses what would read
    the pass there).
    With several mini-batches or epochs and none of those readers, the first mini-batch's forward still runs the
    unmoved weights: with `reuse_first_forward` its rows take their old log-probs from it and the pass covers the
    other rows only (`AFTER_FIRST_MINI_BATCH`); later epochs read the values stored then.
    """
    if bypass:
        return OldPass.NONE
    read_before_update = kl_in_reward or correction or adaptive_entropy or distill
    if read_before_update:
        return OldPass.ALL_ROWS
    if ppo_epochs == 1 and mini_batches == 1:
        return OldPass.NONE
    # a second optimizer step sees moved weights (ratio != 1): its rows need the pass, the first mini-batch's may not
    return OldPass.AFTER_FIRST_MINI_BATCH if reuse_first_forward else OldPass.ALL_ROWS


def sampled_validation_metrics(scores: Sequence[dict[str, float]], n: int) -> dict[str, float]:
    """Per-prompt statistics of `n` samples per prompt (sample `j` of prompt `i` at `i * n + j`), averaged over prompts:
    `val/reward/mean@n` (mean `overall`), `val/reward/best@n` (best `overall` of the n) and `val/pass@n` (share of
    prompts with at least one sample passing: its `accuracy`, or `overall` without one, is at least 1, a full
    score). Greedy validation of a model that is already good hides learning that these show."""
    if n < 1 or not scores or len(scores) % n:
        raise ValueError(f"sampled_validation_metrics: {len(scores)} scores do not make groups of n={n} samples")
    groups = [scores[i : i + n] for i in range(0, len(scores), n)]
    mean = sum(sum(s["overall"] for s in g) / n for g in groups) / len(groups)
    best = sum(max(s["overall"] for s in g) for g in groups) / len(groups)
    # A sample whose reward call failed carries only the fallback `overall`: it passes on that.
    passed = sum(any(s.get("accuracy", s["overall"]) >= 1.0 for s in g) for g in groups) / len(groups)
    return {f"val/reward/mean@{n}": mean, f"val/reward/best@{n}": best, f"val/pass@{n}": passed}


def first_nonfinite(batch: Batch, keys: Sequence[str]) -> str | None:
    """The first of `keys` holding a NaN/inf on a trained response token (`loss_mask`), or None."""
    mask = batch["loss_mask"].bool()
    for key in keys:
        if key in batch and not torch.isfinite(batch[key][mask]).all():
            return key
    return None


def apply_rollout_correction(
    batch: Batch, cfg: RolloutCorrectionConfig, version: int | None = None
) -> dict[str, float]:
    """The rollout-correction stage, before anything reads the old log-probs or the loss mask (KL in the reward, the
    advantages). Bypass mode: the engine's log-probs become `old_log_probs`. Otherwise the engine-vs-actor
    diagnostics, and with a correction on: `rollout_is_weights` (B, R) for the loss, and `loss_mask` less the
    rejected tokens, with each score moved onto its row's last kept token."""
    if "rollout_log_probs" not in batch:
        if cfg.reads_rollout_log_probs:  # role_specs asks the engines for them: a rollout loop dropped them
            raise ValueError("the rollout correction needs rollout_log_probs, and the rollout gave none")
        return {}
    if cfg.bypass_mode:
        batch.set(old_log_probs=batch["rollout_log_probs"])
        return {}  # the engine compared with itself: no diagnostics
    # Measured here against the old-log-prob pass; without it the update's own forward measures them.
    metrics = logprob_consistency(batch, version) if "old_log_probs" in batch else {}
    if not cfg.active:
        return metrics
    out = correct_rollout(batch["old_log_probs"], batch["rollout_log_probs"], batch["loss_mask"], cfg)
    if out.weights is not None:
        batch.set(rollout_is_weights=out.weights)
    if cfg.rollout_rs is not None or cfg.rollout_token_veto_threshold is not None:
        # A reward-to-go estimator drops a reward standing on an untrained token: move each score onto the last token
        # still trained (a whole rejected row keeps its score for its group's baseline, and trains nothing).
        scores = batch["token_level_scores"].sum(dim=1).tolist()
        batch.set(loss_mask=out.loss_mask, token_level_scores=token_level_scores(scores, out.loss_mask))
    return metrics | out.metrics


def logprob_consistency(batch: Batch, version: int | None = None) -> dict[str, float]:
    """The engine-vs-actor figures (`easyrl.algorithms.logprob_gap`: `rollout/logprob_diff_mean`, `_max`,
    `rollout/token_prob_error`) of the engine's log-probs against the old-log-prob pass's, over the trained tokens of
    the rows the engine gave log-probs for, and with asynchronous rollouts over the tokens the pass's own weights
    (policy `version`) sampled; none when there are none. Without the pass the update's forward measures them
    (`easyrl.workers.actor.policy_objective`)."""
    versions = batch.tensors.get("token_policy_version")
    scored = scored_tokens(batch["loss_mask"], batch.tensors.get("rollout_logprob_mask"), versions, version)
    return logprob_gap(batch["rollout_log_probs"], batch["old_log_probs"], scored).metrics()


def data_metrics(batch: Batch, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """verl-named statistics of scores, rewards, advantages, returns, values and lengths (rows without tokens, a
    diffusion run's images, have no lengths: their "tokens" are denoising steps of a fixed count)."""
    mask = batch["loss_mask"].float()
    seq_score = batch["token_level_scores"].sum(dim=1)
    seq_reward = batch["token_level_rewards"].sum(dim=1)
    out: dict[str, float] = {}
    for name, values in (("score", seq_score), ("rewards", seq_reward)):
        out |= {
            f"critic/{name}/mean": float(values.mean()),
            f"critic/{name}/max": float(values.max()),
            f"critic/{name}/min": float(values.min()),
        }
    for name in ("advantages", "returns", "values"):
        if name in batch:
            valid = batch[name][mask.bool()]
            if valid.numel():
                out |= {
                    f"critic/{name}/mean": float(valid.mean()),
                    f"critic/{name}/max": float(valid.max()),
                    f"critic/{name}/min": float(valid.min()),
                }
    if not has_tokens(batch):
        return out
    # verl's response length: every response token the model saw (`response_mask`), tool output too
    response_length = batch["response_mask"].float().sum(dim=1)
    prompt_length = batch["attention_mask"][:, : batch["prompts"].shape[1]].float().sum(dim=1)
    for name, lengths, limit in (
        ("response_length", response_length, max_response_length),
        ("prompt_length", prompt_length, max_prompt_length),
    ):
        out |= {
            f"{name}/mean": float(lengths.mean()),
            f"{name}/max": float(lengths.max()),
            f"{name}/min": float(lengths.min()),
            f"{name}/clip_ratio": float((lengths >= limit).float().mean()),  # the share that hit the length limit
        }
    if "entropys" in batch:
        out["actor/entropy_rollout"] = float(masked_mean(batch["entropys"], mask))
    return out


def policy_version_metrics(batch: Batch) -> dict[str, float]:
    """The oldest and newest policy that sampled the batch (`policy_version` (B,) int64): equal in the synchronous
    loop; apart once rollouts overlap training."""
    versions = batch["policy_version"]
    return {
        "rollout/policy_version_min": float(versions.min()),
        "rollout/policy_version_max": float(versions.max()),
    }


def resumed_policy_version(global_step: int, critic_warmup: int) -> int:
    """The policy version after `global_step` steps, for a resumed run: one actor update per step past the critic
    warm-up. A step whose update the driver skipped for non-finite advantages is counted too (such steps are rare
    and bounded by `max_consecutive_skips`); the checkpoint itself does not record the version."""
    return max(0, global_step - critic_warmup)


def throughput_metrics(batch: Batch, timings: dict[str, float], n_workers: int) -> dict[str, float]:
    """Tokens per second per worker over the whole step, and milliseconds per token of each stage; for rows without
    tokens (images), samples per second per worker (`perf/images_per_s`) and seconds per sample of each stage."""
    if not has_tokens(batch):
        step, samples = timings.get("step", 0.0), float(len(batch))
        out = {"perf/time_per_step": step, "perf/images_per_s": samples / max(step, 1e-9) / n_workers}
        return out | {f"timing_per_sample_s/{stage}": s / max(samples, 1.0) for stage, s in timings.items()}
    total_tokens = float(batch["attention_mask"].sum())
    response_tokens = float(batch["response_mask"].sum())  # generation work: every response token, tool output too
    step = timings.get("step", 0.0)
    out = {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step,
        "perf/throughput": total_tokens / max(step, 1e-9) / n_workers,
    }
    for stage, seconds in timings.items():
        # generation makes the response tokens; the other stages read whole sequences
        tokens = response_tokens if stage == "gen" else total_tokens
        out[f"timing_per_token_ms/{stage}"] = 1000.0 * seconds / max(tokens, 1.0)
    return out


def has_tokens(batch: Batch) -> bool:
    """Rows of token sequences (an LLM's prompt and response), not a diffusion run's sampled images."""
    return "prompts" in batch


def mean_entropy(batch: Batch) -> float:
    """The rollout's entropy (`entropys` (B, R)) averaged over the trained tokens: what the entropy controller
    steers."""
    mask = batch["loss_mask"]
    return float((batch["entropys"] * mask).sum() / mask.sum().clamp(min=1))


def mini_batch_major_order(rows: int, mini_batch_rows: int, dp: int) -> list[int]:
    """Row order for an update call: `Dispatch.DP_SPLIT` hands data-parallel group `r` the `r`-th contiguous chunk,
    and each worker steps through its chunk `mini_batch_rows / dp` rows at a time; in this order, chunk `r` holds the
    `r`-th share of every global mini-batch (rows `[k * mini_batch_rows, (k + 1) * mini_batch_rows)`), in order, so
    optimizer step `k` sees global mini-batch `k` at every data-parallel size (at 1 it is the identity)."""
    if mini_batch_rows < 1 or rows % mini_batch_rows or mini_batch_rows % dp:
        raise ValueError(
            f"mini_batch_major_order: {rows} rows do not split into mini-batches of {mini_batch_rows} rows over {dp} "
            "data-parallel groups (config validation keeps global_batch_size * n dividing both)"
        )
    share = mini_batch_rows // dp
    minis = rows // mini_batch_rows
    # Outer loop over the data-parallel groups: group r's chunk lists its share of mini-batch 0, then of 1, ...
    return [k * mini_batch_rows + r * share + i for r in range(dp) for k in range(minis) for i in range(share)]
