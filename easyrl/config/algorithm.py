"""Configuration of the RL algorithm: advantage estimator, KL, entropy, online filtering, rollout correction
(``algorithm.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from easyrl.config.model_ref import ModelRefConfig


class KLMode(str, Enum):
    """Where the KL to the reference policy goes, derived once from `disable_kl` and `use_kl_loss`."""

    OFF = "off"
    """No KL and no reference model."""
    IN_REWARD = "in_reward"
    """Subtracted from the token-level reward (fixed or adaptive coefficient)."""
    IN_LOSS = "in_loss"
    """Added to the actor loss."""


@dataclass
class RolloutCorrectionConfig:
    """Corrections for the gap between the policy that sampled (the rollout engine's per-token log-probs) and the
    policy the update starts from (pi_old), with verl's option names (`algorithm.rollout_correction` there too).
    All off by default. See docs/algorithms.md, "Rollout correction"."""

    rollout_is: str | None = None
    """Importance weights pi_old / pi_rollout multiplied into the policy loss: token (one weight per token),
    sequence (the product over the sequence's trained tokens, on each of them) or null (none)."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the importance weights: truncated IS (weights above it are clamped to it), or with
    `rollout_is_threshold_lower` the upper edge of the IcePop band."""
    rollout_is_threshold_lower: float | None = None
    """Masked IS (IcePop): weights outside [lower, rollout_is_threshold] are zeroed instead of clamped (the tokens
    stay in the loss's denominator). Null: truncated IS. verl's newest versions write the band as one
    `rollout_is_threshold: "lower_upper"` string (e.g. "0.5_5.0"); here it is the two keys."""
    rollout_is_batch_normalize: bool = False
    """Divide the importance weights by their batch mean (over trained tokens for token weights, over sequences for
    sequence weights), so they average 1."""
    rollout_rs: str | None = None
    """Rejection sampling: token (each token by its own ratio), sequence (each sequence by the product of its
    ratios), geometric (by their geometric mean) or null (none). A token or sequence whose ratio is outside
    [rollout_rs_threshold_lower, rollout_rs_threshold] leaves `loss_mask` (counted in the metrics)."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the rejection band; required with `rollout_rs` (verl's geo-RS preset uses 1.001)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the rejection band. Null: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None
    """Veto: a sequence holding any trained token whose ratio pi_old / pi_rollout is below this leaves `loss_mask`
    whole (verl's presets use 1e-4). Null: off."""
    bypass_mode: bool = False
    """The rollout engine's per-token log-probs serve as the old policy: `old_log_probs = rollout_log_probs`, and
    the actor's old-log-prob pass never runs. Excludes the options above (they compare against a pi_old that
    bypass does not compute) and adaptive entropy (which reads that pass's entropy)."""

    @property
    def active(self) -> bool:
        """Importance weights, rejection or veto is on: each compares pi_old with the engine's log-probs."""
        return (
            self.rollout_is is not None or self.rollout_rs is not None or self.rollout_token_veto_threshold is not None
        )

    @property
    def reads_rollout_log_probs(self) -> bool:
        """The engine must return the log-probs of every sample (a correction, or bypass mode)."""
        return self.active or self.bypass_mode


DISTILL_MODES = ("k1", "k3", "topk_fkl")
"""`algorithm.distill.mode`: the per-token penalty of the student's sampled tokens against the teacher."""


@dataclass
class DistillConfig:
    """On-policy distillation: a teacher scores exactly the tokens the student sampled, and each token's advantage
    becomes `A - coef * penalty(log pi - log pi_teacher)`. Off while `teacher` is unset. See docs/algorithms.md,
    "On-policy distillation"."""

    teacher: ModelRefConfig = field(default_factory=ModelRefConfig)
    """The teacher, sharing the student's tokenizer (checked at start): a local checkpoint (`model_path`), run in an
    FSDP role of its own, sharded, offloaded and micro-batched as the reference (`worker.ref`) and with the actor's
    forward settings; or a vLLM server (`base_url`, with `tokenizer_path` a local copy of its tokenizer, and
    `worker.rollout.temperature: 1`), asked for the prompt log-probs of each sampled sequence."""
    coef: float = 1.0
    """Weight of the teacher's penalty in each token's advantage (`k1`, `k3`), or of the forward-KL loss term
    (`topk_fkl`)."""
    mode: str = "k1"
    """The penalty, with `d = log pi(a) - log pi_teacher(a)` for the sampled token `a`: `k1` is `d` (the per-token
    reverse KL, as in Thinking Machines' on-policy distillation), `k3` is `exp(-d) + d - 1` (never negative, lower
    variance, clamped to [-10, 10]). `topk_fkl`: no penalty in the advantage, but a loss term: at each sampled
    position the forward KL over the teacher's `top_k` most likely tokens, `sum_j p_T(j) (log p_T(j) - log
    p_S(j))`, through the student's logits at those tokens (a local teacher, with `worker.actor.fused_logprobs:
    false` and `worker.actor.ulysses_size: 1`)."""
    top_k: int = 8
    """`topk_fkl`: the teacher's most likely tokens per position that the forward KL runs over."""
    with_task_reward: bool = True
    """Add the penalty to the advantage of the task reward from `algorithm.adv_estimator` (true), or train on the
    teacher alone (false: the task reward is still scored and logged, and validation reads it)."""

    @property
    def enabled(self) -> bool:
        """A teacher is declared."""
        return self.teacher.declared


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, by registered name: grpo, dr_grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, gae, grpo_passk, or one you registered."""
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; false gives Dr.GRPO's unnormalized advantage."""
    disable_kl: bool = False
    """No KL at all: no reference model is built."""
    use_kl_loss: bool = False
    """Put the KL to the reference policy in the actor loss (true) or subtract it from the reward (false)."""

    @property
    def kl_mode(self) -> KLMode:
        """`disable_kl` and `use_kl_loss` read once: where the KL goes (nowhere, the reward or the loss)."""
        if self.disable_kl:
            return KLMode.OFF
        return KLMode.IN_LOSS if self.use_kl_loss else KLMode.IN_REWARD

    kl_penalty: str = "kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_coef: float = 1e-3
    """KL coefficient (the initial one for the adaptive controller)."""
    kl_type: str = "fixed"
    """KL-in-reward controller: fixed or adaptive."""
    kl_target: float = 0.1
    """Adaptive KL controller: the KL it steers towards."""
    kl_horizon: float = 10000.0
    """Adaptive KL controller: horizon in samples."""
    online_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose `filter_key` scores are all equal or out of range, and keep
    sampling until the batch is full."""
    filter_key: str = "overall"
    """Reward key used by online filtering."""
    filter_low: float = 0.01
    """Online filtering keeps groups whose mean score is above this."""
    filter_high: float = 0.99
    """Online filtering keeps groups whose mean score is below this."""
    max_try_make_batch: int = 20
    """Online filtering: most sampling tries per step before stopping with an error (-1: no limit)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (fixed). Ignored when `adaptive_entropy` is on."""
    adaptive_entropy: bool = False
    """Skywork-OR1 adaptive entropy control: the bonus applies only while entropy is below its target."""
    entropy_target: float = 0.2
    """Adaptive entropy: target token entropy."""
    entropy_delta: float = 1e-4
    """Adaptive entropy: coefficient step per update."""
    entropy_min_coef: float = 0.0
    """Adaptive entropy: lowest coefficient."""
    entropy_max_coef: float = 0.01
    """Adaptive entropy: highest coefficient."""
    entropy_init_coef: float = 0.0
    """Adaptive entropy: initial coefficient."""
    user_modules: list[str] = field(default_factory=list)
    """Python files imported in the driver and in every worker before the run: estimators and losses they
    register with `@register_advantage_estimator` / `@register_policy_loss` can then be selected by name."""
    tis_cap: float | None = None
    """A preset: `tis_cap: X` is `rollout_correction: {rollout_is: token, rollout_is_threshold: X}` (token-level
    truncated importance sampling against the engine's log-probs). Null: off."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy corrections between the rollout engine and the trained policy (verl's names): importance
    weights, rejection sampling, bypass mode."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off unless `distill.teacher` is set)."""

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """`rollout_correction` with the `tis_cap` preset applied: what the run does (validation refuses the preset
        beside an explicit `rollout_is`)."""
        if self.tis_cap is None:
            return self.rollout_correction
        return replace(self.rollout_correction, rollout_is="token", rollout_is_threshold=self.tis_cap)
