"""Partial-credit reward for the digits demo task (copy or reverse a short list of digits).

EasyR1 batch contract: `compute_score(reward_inputs)` takes a list of dicts with `response` (decoded text, special
tokens skipped), `response_length` and `ground_truth`, and returns one dict of scores per input.

Scores, all in [0, 1]:

- `accuracy`: characters of the (whitespace-stripped) response equal to the answer's at the same position, divided
  by the longer of the two lengths; so a missing, extra or wrong digit each cost one position.
- `format`: 0.5 for a response of ASCII digits only, plus 0.5 for one exactly as long as the answer (the model
  stopped at the right place).
- `overall`: `0.9 * accuracy + 0.1 * format`; with `exact_match=True` (a keyword argument,
  `worker.reward.reward_function_kwargs`), 1 for a response exactly the answer and 0 otherwise: the sparse,
  all-or-nothing reward of most verifiable tasks (the on-policy distillation figures in docs/benchmarks.md use it).

Example: answer `183`, response `18` -> accuracy 2/3, format 0.5, overall 0.65 (0 with `exact_match`).
"""

from __future__ import annotations

import re
from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "digits"

FORMAT_WEIGHT = 0.1
"""Share of `overall` given to the format score."""

_DIGITS = re.compile(r"[0-9]+")


def score_one(response: str, ground_truth: str, exact_match: bool = False) -> dict[str, float]:
    """Score one response against its ground-truth digit string."""
    text = response.strip()
    answer = str(ground_truth).strip()
    matches = sum(a == b for a, b in zip(text, answer))
    longest = max(len(text), len(answer))
    accuracy = matches / longest if longest else 1.0
    only_digits = _DIGITS.fullmatch(text) is not None
    right_length = len(text) == len(answer)
    format_score = 0.5 * only_digits + 0.5 * right_length
    overall = (1.0 - FORMAT_WEIGHT) * accuracy + FORMAT_WEIGHT * format_score
    if exact_match:
        overall = float(text == answer)
    return {"overall": overall, "format": format_score, "accuracy": accuracy}


def compute_score(
    reward_inputs: list[dict[str, Any]], exact_match: bool = False, **kwargs: Any
) -> list[dict[str, float]]:
    """Score a batch of responses (other keyword arguments are accepted and ignored)."""
    return [score_one(item["response"], item["ground_truth"], exact_match) for item in reward_inputs]


main = compute_score
