"""Names of the built-in algorithms, kept free of torch so a config validates in a fraction of a second.

`easyrl.algorithms` registers exactly these (a test keeps the two in sync); names registered by a user's
`algorithm.user_modules` are looked up in the registry itself.
"""

BUILTIN_ADV_ESTIMATORS = (
    "dr_grpo",
    "gae",
    "grpo",
    "grpo_passk",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
)
BUILTIN_POLICY_LOSSES = ("cispo", "gspo", "gspo_token", "ppo", "sapo", "vanilla")
GROUP_ESTIMATORS = frozenset({"dr_grpo", "grpo", "grpo_passk", "reinforce_plus_plus_baseline", "rloo"})
"""Estimators that compare the responses of one prompt: they need `worker.rollout.n >= 2`."""
KL_PENALTY_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
