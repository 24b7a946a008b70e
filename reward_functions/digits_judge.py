"""A judge-scored reward for the digits demo: the judge answers the task itself and each response is graded against
the judge's answer, never the dataset's.

Use with `worker.reward.judge` (docs/judges_and_distillation.md):

    reward_function: reward_functions/digits_judge.py:compute_score
    judge:
      model: {base_url: http://localhost:8000/v1}
      template: prompt_templates/digits_judge.jinja          # the task, markup off
      parse: reward_functions/digits_judge.py:read_answer    # a reply of digits is an answer
      sampling: {temperature: 0.0, max_tokens: 12}

What the verdict measures: how far the response is from the judge's own greedy answer, by the digits demo's
partial-credit formula (`reward_functions/digits.py`, the judge's answer in place of the ground truth). A small
model that cannot write a rubric can still do the task; its answer is the reference. The reward is only as right as
the judge: each sample also logs `judge_correct` (the judge's answer is the dataset's), `judge_rule` (the judge's
answer under the dataset's answer, by the same formula) and `rule` (the response under the dataset's answer); none
is trained on, they show how far the judge's reward is from the truth.
"""

from __future__ import annotations

import re
from typing import Any

from digits import score_one


REWARD_TYPE = "batch"
REWARD_NAME = "digits_judge"

_DIGITS = re.compile(r"[0-9]+")


def read_answer(text: str) -> float | None:
    """The judge's `parse`: 1 for a reply of digits (an answer to grade against), None (a parse error) otherwise."""
    return 1.0 if _DIGITS.fullmatch(text.strip()) else None


def compute_score(
    reward_inputs: list[dict[str, Any]], judge: Any, exact_match: bool = False
) -> list[dict[str, float]]:
    """`overall`: the response scored against the judge's answer to its prompt (0 when the judge gave none);
    `judge_ok`, `judge_correct`, `judge_rule` and `rule` as in the module docstring."""
    # The judge answers the prompt alone (greedy), so a group's n samples share one request.
    first: dict[str, dict[str, Any]] = {}
    for item in reward_inputs:
        first.setdefault(item["prompt"], item)
    verdicts = dict(zip(first, judge.verdict_batch(list(first.values()))))
    out = []
    for item in reward_inputs:
        verdict = verdicts[item["prompt"]]
        truth = str(item["ground_truth"]).strip()
        answer = verdict.text.strip() if verdict.ok and verdict.text is not None else None
        overall = score_one(item["response"], answer, exact_match)["overall"] if answer is not None else 0.0
        out.append(
            {
                "overall": overall,
                "judge_ok": float(answer is not None),
                "judge_correct": float(answer == truth),
                "judge_rule": score_one(answer, truth)["overall"] if answer is not None else 0.0,
                "rule": score_one(item["response"], truth, exact_match)["overall"],
            }
        )
    return out


main = compute_score
