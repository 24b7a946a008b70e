"""Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens."""

from __future__ import annotations

import torch

# The accepted values of ``algorithm.kl_penalty`` live with the torch-free names the validator reads; ``full`` is
# recognised below but rejected (it needs full logits).
from easyrl.config.names import KL_PENALTY_KINDS


__all__ = ["KL_PENALTY_KINDS", "kl_penalty"]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL penalty between the current policy and the reference policy.

    With ``d = log_prob - ref_log_prob`` (log pi(a) - log pi_ref(a) for the sampled token a ~ pi):

    * ``kl`` / ``k1``: ``d`` (unbiased, high variance, can be negative).
    * ``abs``: ``|d|``.
    * ``mse`` / ``k2``: ``0.5 * d**2``.
    * ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` (unbiased, always >= 0), clamped to [-10, 10].

    Args:
        log_prob: (B, T) log-probs under the current policy.
        ref_log_prob: (B, T) log-probs under the reference policy.
        kl_penalty: estimator name, one of ``KL_PENALTY_KINDS``.

    Returns:
        (B, T) per-token penalty (not masked; the caller aggregates with the response mask).
    """
    diff = log_prob - ref_log_prob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_penalty in ("low_var_kl", "k3"):
        # Clamp the log-ratio before exp so far-off tokens cannot overflow to inf (and NaN gradients); at |x| = 20
        # the k3 value already exceeds 10, so the final clamp makes this invisible in the result.
        log_ratio = (-diff).clamp(min=-20.0, max=20.0)
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3.clamp(min=-10.0, max=10.0)
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' needs the full-vocabulary logits of both policies, which are not kept; "
            f"use one of {', '.join(KL_PENALTY_KINDS)}"
        )
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; choose one of {', '.join(KL_PENALTY_KINDS)}")
