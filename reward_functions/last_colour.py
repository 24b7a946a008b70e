"""Reward of the last-colour task (`easyrl.testing.long_video`, configs/demo_long_video.yaml): which colour a long
video ends on.

EasyR1 batch contract: `compute_score(reward_inputs)` takes a list of dicts with `response` and `ground_truth` (a
colour letter: R, G, B or Y) and returns one dict of scores per input, each 0 or 1:

- `accuracy`: the response's first letter (spaces skipped, case ignored) is the answer;
- `format`: that first letter is one of the four colour letters;
- `overall`: `accuracy` (a well-formed wrong answer earns nothing: guessing is worth 1 in 4 on average).

Example: answer `G`, response ` g.` -> accuracy 1; response `B` -> accuracy 0, format 1.
"""

from __future__ import annotations

from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "last_colour"

LETTERS = frozenset("RGBY")


def score_one(response: str, ground_truth: str) -> dict[str, float]:
    """Score one response against its colour letter."""
    text = response.strip().upper()
    first = text[:1]
    answer = str(ground_truth).strip().upper()
    if answer not in LETTERS:
        raise ValueError(f"ground truth {ground_truth!r} is not a colour letter (R, G, B or Y): check the dataset")
    accuracy = float(first == answer)
    return {"overall": accuracy, "accuracy": accuracy, "format": float(first in LETTERS)}


def compute_score(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [score_one(item["response"], item["ground_truth"]) for item in reward_inputs]
