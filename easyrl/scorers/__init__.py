"""Second models that score the policy's samples: a generative judge and a reward model, each behind a model
reference (`easyrl.config.model_ref.ModelRefConfig`), handed ready to the reward functions that ask for them.

`Scorers` builds them in the process that scores (a reward worker, or the driver with `num_workers: 0`) and drains
their call counters into the step's metrics.
"""

from __future__ import annotations

from typing import Any

from easyrl.config.worker import RewardConfig
from easyrl.scorers.client import CallStats, ModelCallError, RemoteModel, finish_stats


__all__ = [
    "SCORER_ARGS",
    "CallStats",
    "ModelCallError",
    "RemoteModel",
    "Scorers",
    "declared_scorers",
    "finish_stats",
]

SCORER_ARGS = ("judge", "reward_model")
"""The argument names under which a reward function receives a scorer, as the `worker.reward` keys that set them."""


def declared_scorers(cfg: RewardConfig) -> dict[str, str]:
    """Argument name -> metric name of every scorer the config sets (`judge` -> its model's name or `judge`)."""
    out = {}
    for arg in SCORER_ARGS:
        ref = getattr(cfg, arg).model
        if ref.declared:
            out[arg] = ref.name or arg
    return out


class Scorers:
    """The scorers `worker.reward` declares, built (a judge's HTTP client; a local reward model's weights)."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.clients: dict[str, Any] = {}
        declared = declared_scorers(cfg)
        if "judge" in declared:
            from easyrl.scorers.judge import Judge

            self.clients["judge"] = Judge(cfg.judge)
        if "reward_model" in declared:
            from easyrl.scorers.reward_model import RewardModel

            self.clients["reward_model"] = RewardModel(cfg.reward_model)

    def drain(self) -> dict[str, float]:
        """Every scorer's counters since the last drain (additive: see `CallStats.drain`)."""
        out: dict[str, float] = {}
        for client in self.clients.values():
            for key, value in client.stats.drain().items():
                out[key] = out.get(key, 0.0) + value
        return out
