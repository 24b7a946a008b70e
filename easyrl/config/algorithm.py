"""Configuration of the RL algorithm: advantage estimator, KL, entropy, online filtering (``algorithm.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class KLMode(str, Enum):
    """Where the KL to the reference policy goes, derived once from `disable_kl` and `use_kl_loss`."""

    OFF = "off"
    """No KL and no reference model."""
    IN_REWARD = "in_reward"
    """Subtracted from the token-level reward (fixed or adaptive coefficient)."""
    IN_LOSS = "in_loss"
    """Added to the actor loss."""


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
    """Truncated importance sampling against rollout/actor log-prob mismatch: weights capped at this value.
    None: off."""
