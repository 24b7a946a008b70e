"""Rewards from a second model: a generative judge's verdict (`compute_score`) or a reward model's score
(`reward_model_score`), for `worker.reward.judge` / `worker.reward.reward_model` (docs/judges_and_distillation.md).

Both are batch functions: the judge's requests go out together, up to its model's `max_concurrency` at once, and
the reward model scores in batches. `judge_ok` is 1 when the judge answered with a readable score (0 marks a
zero verdict of `on_error: zero`).
"""

from __future__ import annotations

from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "judge"


def compute_score(reward_inputs: list[dict[str, Any]], judge: Any, scale: float = 1.0) -> list[dict[str, float]]:
    """`overall` = the judge's score times `scale` (e.g. 0.1 for a 0-10 rubric)."""
    verdicts = judge.verdict_batch(reward_inputs)
    return [{"overall": v.score * scale, "judge_ok": float(v.ok)} for v in verdicts]


def reward_model_score(reward_inputs: list[dict[str, Any]], reward_model: Any) -> list[dict[str, float]]:
    """`overall` = the reward model's score of (prompt, response)."""
    return [{"overall": score} for score in reward_model.score_batch(reward_inputs)]


main = compute_score
