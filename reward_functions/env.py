"""Reward from the environment: `overall` is the `env_reward` a multi-turn rollout read from the environment's
`get_reward()` once the trajectory ended (docs/agentic.md). A trajectory without one (no `get_reward`, or it
raised) is an error the reward manager counts, scored `fallback_score`."""

from __future__ import annotations

from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "env"


def compute_score(reward_inputs: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        if item.get("env_reward") is None:
            raise ValueError("no env_reward: the environment has no get_reward(), or it raised (see the log)")
        scores.append({"overall": float(item["env_reward"])})
    return scores


main = compute_score
