"""On-policy distillation: a teacher scores the tokens the student sampled, and each token's advantage is pushed
towards the teacher.

The student samples `a ~ pi`; the teacher gives `log pi_teacher(a)` for exactly those tokens. With
`d = log pi(a) - log pi_teacher(a)` the per-token advantage is `A - coef * penalty(d)`:

* `k1`: `penalty = d`, a one-sample estimate of the reverse KL `KL(pi || pi_teacher)` at that token. Its policy
  gradient is the gradient of the reverse KL (Agarwal et al., *On-Policy Distillation of Language Models*, 2024;
  Thinking Machines, *On-Policy Distillation*, 2025), with no discount: each token answers for itself.
* `k3`: `penalty = exp(-d) + d - 1` (Schulman's k3), never negative and of lower variance; it is biased as a
  gradient signal (it punishes tokens the teacher likes more than the student, too), and is offered for the
  smoother curve it gives.

Where we depart from the papers: `A` is the task advantage of the configured estimator (or 0 without the task
reward), so the same loss (PPO clip included) trains both signals; the papers use the teacher alone.

`topk_fkl` is not an advantage but a loss term (`topk_forward_kl`): at each sampled position, the forward KL over the
teacher's k most likely tokens, `sum_j p_T(j) (log p_T(j) - log p_S(j))`, differentiated through the student's
log-probs at those tokens (the teacher's mass outside its top k is left out, as in top-k logit distillation).
"""

from __future__ import annotations

import torch

from easyrl.algorithms.kl import kl_penalty


__all__ = ["DISTILL_PENALTIES", "distill_advantages", "topk_forward_kl"]

DISTILL_PENALTIES = {"k1": "k1", "k3": "k3"}
"""`algorithm.distill.mode` -> the `kl_penalty` estimator that computes its per-token penalty."""


def distill_advantages(
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    mode: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The task advantages with the teacher's per-token penalty subtracted.

    Args:
        advantages: (B, T) advantages of the task reward (zeros to train on the teacher alone).
        log_prob: (B, T) the student's log-probs of its sampled tokens (the policy that sampled, pi_old).
        teacher_log_prob: (B, T) the teacher's log-probs of the same tokens.
        response_mask: (B, T) 1 on trained tokens; the result is 0 elsewhere.
        coef: weight of the penalty.
        mode: `k1` or `k3` (see the module docstring).

    Returns:
        ((B, T) `advantages - coef * penalty` on trained tokens, (B, T) the penalty itself, 0 off the mask).
    """
    if mode not in DISTILL_PENALTIES:
        raise ValueError(f"unknown distillation mode {mode!r}; choose one of {', '.join(DISTILL_PENALTIES)}")
    mask = response_mask.to(advantages.dtype)
    # Selected, not multiplied: a padding position may hold anything (-inf from a teacher head), never NaN here.
    penalty = torch.where(
        mask.bool(),
        kl_penalty(log_prob=log_prob, ref_log_prob=teacher_log_prob, kl_penalty=DISTILL_PENALTIES[mode]),
        0,
    )
    return (advantages - coef * penalty) * mask, penalty


def topk_forward_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """The forward KL of each position over the teacher's top-k tokens, `sum_j p_T(j) (log p_T(j) - log p_S(j))`.

    Args:
        student_log_probs: (B, T, k) the student's log-probs at the teacher's top-k token ids (with gradient).
        teacher_log_probs: (B, T, k) the teacher's log-probs of those ids (no gradient).

    Returns:
        (B, T) the per-position term; padding positions give whatever their inputs give (mask it with `agg_loss`).
    """
    teacher = teacher_log_probs.detach().float()
    return (teacher.exp() * (teacher - student_log_probs.float())).sum(dim=-1)
