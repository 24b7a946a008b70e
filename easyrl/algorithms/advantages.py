"""Built-in advantage estimators.

Every estimator takes ``token_level_rewards`` R and ``response_mask`` M, both (B, T), and ``index``: a length-B
sequence of hashable group ids (the samples drawn for one prompt share an id). It returns ``(advantages, returns)``
of shape (B, T), both zero on masked tokens. The sequence score of sample i is ``s_i = sum_t R[i, t]``.
Estimators accept and ignore extra keyword arguments, because the trainer passes one common set to all of them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from easyrl.algorithms.aggregation import masked_whiten
from easyrl.algorithms.registry import register_advantage_estimator
from easyrl.config.names import BUILTIN_ESTIMATOR_NEEDS


__all__ = [
    "compute_dr_grpo_advantage",
    "compute_gae_advantage",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "group_ids",
]


def group_ids(index: Iterable[Hashable] | torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map arbitrary hashable group ids to dense integers 0..G-1 in order of first appearance.

    Args:
        index: B group ids (list, numpy array or tensor).
        batch_size: expected B.
        device: device of the result.

    Returns:
        (B,) int64 tensor of dense group ids.
    """
    # Tensor elements hash by identity, so compare their Python values instead.
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries but the batch has {batch_size} rows")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std, gathered back to the samples.

    Args:
        scores: (B,) sequence scores.
        gid: (B,) dense group ids.

    Returns:
        ``(count, mean, std)``, each (B,). Groups of one get mean 0 and std 1 (no peer to compare against).
    """
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    # Per-group sums by scatter-add over the dense ids: (G,) counts, totals and squared deviations.
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = total / count
    sq_dev = (scores - mean[gid]) ** 2
    sq_total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, sq_dev)
    # unbiased (n - 1); the clamp only guards groups of one, whose std is replaced below
    std = torch.sqrt(sq_total / (count - 1).clamp(min=1.0))
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[gid], mean[gid], std[gid]


def _reverse_discounted_sum(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = R_t + gamma * G_{next valid t}`` over valid tokens; masked tokens are skipped and get 0.

    Args:
        rewards: (B, T).
        mask: (B, T).
        gamma: discount factor.

    Returns:
        (B, T) reward-to-go.
    """
    mask_f = mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])  # (B,): the return after the last token is 0
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask_f[:, t]
        # A masked token leaves the running sum untouched, so the chain links valid tokens only.
        running = m * (rewards[:, t] + gamma * running) + (1.0 - m) * running
        out[:, t] = running * m
    return out


@register_advantage_estimator("grpo", needs=BUILTIN_ESTIMATOR_NEEDS["grpo"])
@torch.no_grad()
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``A_i = (s_i - mean_g) / (std_g + epsilon)`` for every valid token of sample i in group g.

    ``std_g`` is the unbiased sample std. A group of one has mean 0 and std 1. With ``norm_adv_by_std=False``
    there is no division (Dr.GRPO).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: B group ids.
        epsilon: added to the std.
        norm_adv_by_std: divide by the group std.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid = group_ids(index, scores.shape[0], scores.device)
    _, mean, std = _group_stats(scores, gid)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    # (B, 1) * (B, T): the sequence's advantage on each valid token
    adv_tok = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv_tok, adv_tok


@register_advantage_estimator("dr_grpo", needs=BUILTIN_ESTIMATOR_NEEDS["dr_grpo"])
@torch.no_grad()
def compute_dr_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``A_i = s_i - mean_g`` (GRPO without the std division; ``norm_adv_by_std`` is ignored).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: B group ids.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    return compute_grpo_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        epsilon=epsilon,
        norm_adv_by_std=False,
    )


@register_advantage_estimator("rloo", needs=BUILTIN_ESTIMATOR_NEEDS["rloo"])
@torch.no_grad()
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``A_i = s_i - mean of the other samples of its group``; a group of one gets 0.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: B group ids.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid = group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_stats(scores, gid)
    # The leave-one-out mean is (n * mean - s_i) / (n - 1); for n = 1 it does not exist and A = 0.
    loo_mean = (count * mean - scores) / (count - 1).clamp(min=1.0)
    adv = torch.where(count > 1, scores - loo_mean, torch.zeros_like(scores))
    adv_tok = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv_tok, adv_tok


@register_advantage_estimator("reinforce_plus_plus", needs=BUILTIN_ESTIMATOR_NEEDS["reinforce_plus_plus"])
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor | None = None,
    gamma: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over all valid tokens of the batch.

    ``G_t = R_t + gamma * G_{t+1}`` (chained over valid tokens); ``A = (G - mean) * rsqrt(var + 1e-8)`` with the
    masked mean and unbiased variance of G over the batch.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: unused (kept for the common signature).
        gamma: discount factor.

    Returns:
        ``(advantages, returns)``: whitened G and raw G, both (B, T).
    """
    returns = _reverse_discounted_sum(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_advantage_estimator(
    "reinforce_plus_plus_baseline", needs=BUILTIN_ESTIMATOR_NEEDS["reinforce_plus_plus_baseline"]
)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``s_i - mean_g`` on every valid token, then whitened over the batch's valid tokens.

    A group of one keeps ``s_i`` (its mean counts as 0). Whitening uses the masked mean and unbiased variance.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: B group ids.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid = group_ids(index, scores.shape[0], scores.device)
    _, mean, _ = _group_stats(scores, gid)
    centered = (scores - mean).unsqueeze(-1) * response_mask.to(scores.dtype)
    adv = masked_whiten(centered, response_mask)
    return adv, adv


@register_advantage_estimator("remax", needs=BUILTIN_ESTIMATOR_NEEDS["remax"])
@torch.no_grad()
def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy response's score.

    ``G_t = sum_{t' >= t, valid} R_t'`` and ``A_t = G_t - b_i`` on valid tokens, ``b_i = reward_baselines[i]``.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: unused.
        reward_baselines: (B,) score of the greedy sample of the same prompt (required).

    Returns:
        ``(advantages, returns)``, both (B, T).
    """
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines (B,): the scores of greedy samples")
    returns = _reverse_discounted_sum(token_level_rewards, response_mask, 1.0)
    # (B, 1), broadcast over the tokens
    baselines = reward_baselines.to(device=returns.device, dtype=returns.dtype).reshape(-1, 1)
    adv = (returns - baselines) * response_mask.to(returns.dtype)
    return adv, returns


@register_advantage_estimator("gae", needs=BUILTIN_ESTIMATOR_NEEDS["gae"])
@torch.no_grad()
def compute_gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a critic.

    Over valid tokens only (t' = the next valid token after t, V_{t'} = 0 past the last one):
    ``delta_t = R_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``.
    ``returns = A + V`` (before whitening); the advantages are then whitened over the batch's valid tokens.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: unused.
        values: (B, T) critic values of the rollout (required).
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both (B, T), zero on masked tokens.
    """
    if values is None:
        raise ValueError("gae needs values (B, T) from the critic")
    mask_f = response_mask.to(token_level_rewards.dtype)
    values = values.to(token_level_rewards.dtype)
    # V past the last valid token is 0: no bootstrap after the response ends
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask_f[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        cand = delta + gamma * lam * last_adv
        # Masked tokens keep the state of the next valid token, so padding in the middle is skipped over.
        last_adv = m * cand + (1.0 - m) * last_adv
        next_value = m * values[:, t] + (1.0 - m) * next_value
        adv[:, t] = cand * m
    returns = (adv + values) * mask_f  # the critic's target, from the unwhitened advantages
    return masked_whiten(adv, response_mask), returns


@register_advantage_estimator("grpo_passk", needs=BUILTIN_ESTIMATOR_NEEDS["grpo_passk"])
@torch.no_grad()
def compute_grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k-oriented GRPO: only the best sample of each group is credited.

    For each group, the best sample (highest score; the first one on ties) gets ``s_best - s_second`` where
    ``s_second`` is the second-highest score (equal to ``s_best`` on a tie, giving 0); all other samples get 0.
    With ``norm_adv_by_std`` that value is divided by ``std_g + epsilon`` (unbiased std of the group's scores).
    A group of one has no runner-up and gets 0.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: B group ids.
        epsilon: added to the std.
        norm_adv_by_std: divide by the group std.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid = group_ids(index, scores.shape[0], scores.device)
    _, _, std = _group_stats(scores, gid)
    adv = torch.zeros_like(scores)
    # Groups are few and small, so a Python loop over them is cheap and much clearer than a segmented top-2.
    for g in range(int(gid.max().item()) + 1 if gid.numel() else 0):
        members = (gid == g).nonzero(as_tuple=True)[0]
        if members.numel() < 2:
            continue
        local = scores[members]
        top = torch.topk(local, k=2).values  # (best, runner-up); equal on a tie, giving 0
        # topk's order among equal values is unspecified, so pick the first index holding the maximum ourselves.
        best = members[(local == top[0]).nonzero(as_tuple=True)[0][0]]
        value = top[0] - top[1]
        if norm_adv_by_std:
            value = value / (std[best] + epsilon)
        adv[best] = value
    adv_tok = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv_tok, adv_tok
