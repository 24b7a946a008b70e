"""How far the rollout engine's log-probs of the sampled tokens are from the trainer's for the same weights: the
training-inference mismatch that kernels, precision (bf16) and a broken weight sync all show up in.

With ``d = log p_engine - log p_trainer`` per scored token (a trained token of a row the engine gave log-probs for):

- `rollout/logprob_diff_mean` and `rollout/logprob_diff_max`: the mean and the max of ``|d|``;
- `rollout/token_prob_error`: the mean of ``exp(|d|)``, NeMo-RL's `token_mult_prob_error` (the figure its recipes
  gate on): 1 when the two agree exactly; above `TOKEN_PROB_ERROR_GATE` (1.05) NeMo-RL calls a run's numerics broken.
  As there, nothing is clamped: one token off by ``ln(2)`` adds ``1 / n`` to it.

Each figure is kept as float64 sums (and a max) rather than a mean, so that the parts of one batch (micro-batches,
ranks) add up to the batch's own figure whatever the layout: a mean of per-part means would weigh the parts wrongly,
since only some rows have engine log-probs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


__all__ = [
    "DIFF_MAX",
    "DIFF_MEAN",
    "TOKEN_PROB_ERROR",
    "TOKEN_PROB_ERROR_GATE",
    "LogprobGap",
    "exact_metrics",
    "logprob_gap",
    "scored_tokens",
]

DIFF_MEAN = "rollout/logprob_diff_mean"
DIFF_MAX = "rollout/logprob_diff_max"
TOKEN_PROB_ERROR = "rollout/token_prob_error"
TOKEN_PROB_ERROR_GATE = 1.05
"""NeMo-RL's bound on `rollout/token_prob_error`: past it, the engine and the trainer disagree beyond bf16 noise."""


@dataclass(frozen=True)
class LogprobGap:
    """The parts of the three figures over some scored tokens, each a float64 0-dim tensor on the inputs' device."""

    tokens: torch.Tensor
    """How many tokens were scored."""
    abs_diff_sum: torch.Tensor
    """Sum of ``|d|``."""
    prob_ratio_sum: torch.Tensor
    """Sum of ``exp(|d|)``."""
    abs_diff_max: torch.Tensor
    """Max of ``|d|``; -inf over no token."""

    def ratios(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The mean figures as (numerator, denominator) pairs: parts add up by summing both."""
        return {DIFF_MEAN: (self.abs_diff_sum, self.tokens), TOKEN_PROB_ERROR: (self.prob_ratio_sum, self.tokens)}

    def maxima(self) -> dict[str, torch.Tensor]:
        """The max figure: parts add up by taking the max."""
        return {DIFF_MAX: self.abs_diff_max}

    def metrics(self) -> dict[str, float]:
        """The three figures; none when no token was scored."""
        ratios = {k: (float(num), float(den)) for k, (num, den) in self.ratios().items()}
        return exact_metrics(ratios, {k: float(v) for k, v in self.maxima().items()})


def scored_tokens(
    loss_mask: torch.Tensor,
    rollout_logprob_mask: torch.Tensor | None,
    token_versions: torch.Tensor | None = None,
    version: int | None = None,
) -> torch.Tensor:
    """(B, T) bool: the trained tokens (`loss_mask` (B, T): the engine gives no log-prob for tool output it did not
    sample) of the rows the engine gave log-probs for (`rollout_logprob_mask` (B,); None: every row, as the HF
    engine gives them) that the compared weights sampled: with asynchronous rollouts (`token_versions` (B, T), the
    policy version that sampled each token) those of `version` only, so that the figures measure the numerics, not
    how far the policy moved since an older version sampled."""
    mask = loss_mask.bool()
    if rollout_logprob_mask is not None:
        mask = mask & rollout_logprob_mask.bool().unsqueeze(1)
    if token_versions is not None and version is not None:
        mask = mask & (token_versions == version)
    return mask


def logprob_gap(engine_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, scored: torch.Tensor) -> LogprobGap:
    """The gap between `engine_log_probs` and `trainer_log_probs` (B, T) over the `scored` (B, T) bool tokens, in
    float64. Unscored positions are selected away, never multiplied by 0: a pad position may hold inf or NaN."""
    diff = (engine_log_probs.double() - trainer_log_probs.double()).abs()
    zero = torch.zeros((), dtype=torch.float64, device=diff.device)
    diff = torch.where(scored, diff, zero)
    below_any = torch.tensor(float("-inf"), dtype=torch.float64, device=diff.device)
    return LogprobGap(
        tokens=scored.sum().to(torch.float64),
        abs_diff_sum=diff.sum(),
        prob_ratio_sum=torch.where(scored, diff.exp(), zero).sum(),
        abs_diff_max=torch.where(scored, diff, below_any).amax() if diff.numel() else below_any,
    )


def exact_metrics(ratios: Mapping[str, tuple[float, float]], maxima: Mapping[str, float]) -> dict[str, float]:
    """Figures from their summed parts: each ratio's numerator over its denominator, each max as is. A figure over
    nothing (denominator 0, max -inf) is left out rather than logged as 0: "no token scored" is not "no gap"."""
    out = {key: num / den for key, (num, den) in ratios.items() if den > 0}
    return out | {key: value for key, value in maxima.items() if value != float("-inf")}
