"""Names of the built-in algorithms, kept free of torch so a config validates in a fraction of a second.

`easyrl.algorithms` registers exactly these (a test keeps the two in sync). Its registry also declares every name it
registers here (a user's `algorithm.user_modules` included), so that the validator knows them, and an estimator's
needs, without importing the registry: the config imports no algorithm. (The rollout engines, and what each can
do, are declared the same way in `config.engines`.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the rest of the run; declared where it is registered
    (`register_advantage_estimator(name, needs=...)`), read by the config validator and the trainer."""

    needs_critic: bool = False
    """A value model: the run starts critic workers and fills `values` (and validates `worker.critic`)."""
    needs_greedy_baseline: bool = False
    """The score of a greedy response per prompt (`reward_baselines`), as ReMax subtracts."""
    grouped: bool = False
    """Compares the responses of one prompt: needs `worker.rollout.n >= 2`."""


BUILTIN_ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    "dr_grpo": EstimatorNeeds(grouped=True),
    "gae": EstimatorNeeds(needs_critic=True),
    "grpo": EstimatorNeeds(grouped=True),
    "grpo_passk": EstimatorNeeds(grouped=True),
    "reinforce_plus_plus": EstimatorNeeds(),
    "reinforce_plus_plus_baseline": EstimatorNeeds(grouped=True),
    "remax": EstimatorNeeds(needs_greedy_baseline=True),
    "rloo": EstimatorNeeds(grouped=True),
}
"""The built-in estimators' needs: `easyrl.algorithms.advantages` registers each with its entry here."""
BUILTIN_ADV_ESTIMATORS = tuple(sorted(BUILTIN_ESTIMATOR_NEEDS))
BUILTIN_POLICY_LOSSES = ("cispo", "gspo", "gspo_token", "ppo", "sapo", "vanilla")
GROUP_ESTIMATORS = frozenset(name for name, needs in BUILTIN_ESTIMATOR_NEEDS.items() if needs.grouped)
"""Built-in estimators that compare the responses of one prompt (they need `worker.rollout.n >= 2`)."""
KL_PENALTY_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# The names the registry has declared, starting with the built-ins (a config naming one validates without torch).
# `easyrl.algorithms.registry` writes here as it registers; only the validator and the registry read it.
_DECLARED_NEEDS: dict[str, EstimatorNeeds] = dict(BUILTIN_ESTIMATOR_NEEDS)
_DECLARED_POLICY_LOSSES: set[str] = set(BUILTIN_POLICY_LOSSES)


def declare_estimator(name: str, needs: EstimatorNeeds) -> None:
    """Record an estimator the registry has just registered, with what it needs (a re-registration replaces it)."""
    _DECLARED_NEEDS[name] = needs


def declare_policy_loss(name: str) -> None:
    """Record a policy loss the registry has just registered."""
    _DECLARED_POLICY_LOSSES.add(name)


def declared_estimators() -> list[str]:
    """Sorted names of the advantage estimators known so far (built-in and registered)."""
    return sorted(_DECLARED_NEEDS)


def declared_policy_losses() -> list[str]:
    """Sorted names of the policy losses known so far (built-in and registered)."""
    return sorted(_DECLARED_POLICY_LOSSES)


def declared_needs(name: str) -> EstimatorNeeds:
    """What the estimator `name` declared it needs; `KeyError` for a name never declared."""
    return _DECLARED_NEEDS[name]
