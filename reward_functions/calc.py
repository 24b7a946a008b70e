"""Reward of the tool demo (configs/demo_tools.yaml): the final answer of a multi-turn trajectory is the product.

Multi-turn rollouts hand the reward function the trajectory's outcome beside the usual fields (docs/agentic.md):
`final_response` (the last assistant turn's text), `tool_calls`, `turns`, `stop_reason` and, from an environment with
`get_reward()`, `env_reward`. Only the answer is scored here: calling the tool earns nothing by itself, it is how
the model finds the product.

Scores: `accuracy` = `overall` = 1 when the final answer, stripped, is the ground truth; `tool_call` = 1 when the
trajectory called a tool (its batch mean is the tool-call rate of the step).
"""

from __future__ import annotations

from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "calc"


def compute_score(reward_inputs: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        # a single-turn run has no final_response: its response is the answer
        answer = str(item.get("final_response", item["response"])).strip()
        right = float(answer == str(item["ground_truth"]).strip())
        scores.append({"overall": right, "accuracy": right, "tool_call": float(item.get("tool_calls", 0) > 0)})
    return scores


main = compute_score
