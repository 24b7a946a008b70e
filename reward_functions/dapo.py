"""DAPO style reward: +1 for a correct ``Answer: ...`` line, -1 otherwise, minus a soft overlong penalty.

The answer is the text after the last ``Answer:`` in the response (to the end of that line). It is normalized
(``$``, ``\\boxed{}``, ``\\text{}``, thousands separators, spaces and a final period removed) and compared with
the normalized ground truth; numbers are compared by value.

Overlong penalty (a sequential reward: it reads ``response_length``, the response's token count): responses longer
than ``max_response_length - overlong_buffer_length`` lose ``overlong_penalty_factor`` times the fraction of the
buffer they use, growing linearly to the full factor at ``max_response_length``. Without ``max_response_length`` or
with a zero buffer there is no penalty. Kwargs, e.g.::

    worker.reward.reward_function=reward_functions/dapo.py:compute_score
    worker.reward.reward_function_kwargs={max_response_length: 4096, overlong_buffer_length: 1024,
                                          overlong_penalty_factor: 1.0}

Outputs: ``overall`` (accuracy score + penalty), ``accuracy`` (1 or 0) and ``overlong_penalty`` (<= 0).
"""

from __future__ import annotations

import re
from typing import Any


REWARD_TYPE = "sequential"
REWARD_NAME = "dapo"

ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]*)", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """Text after the last ``Answer:`` (to the end of its line), or ``None``."""
    matches = ANSWER_PATTERN.findall(response)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def _unwrap(text: str, command: str) -> str:
    """Replace ``\\command{x}`` by ``x`` (nested braces inside ``x`` kept)."""
    while True:
        start = text.find(command + "{")
        if start < 0:
            return text
        pos, depth = start + len(command), 0
        for end in range(pos, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                text = text[:start] + text[pos + 1 : end] + text[end + 1 :]
                break
        else:
            return text  # unbalanced: leave as is


def normalize_answer(text: str) -> str:
    """A canonical form of an answer string for comparison."""
    text = text.strip()
    for command in ("\\boxed", "\\text", "\\textbf", "\\mathrm"):
        text = _unwrap(text, command)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "").replace("$", "")
    text = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    return text.lower()


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def is_correct(answer: str, ground_truth: Any) -> bool:
    """Whether ``answer`` equals ``ground_truth`` after normalization (a list: any of its items)."""
    if isinstance(ground_truth, list | tuple):
        return any(is_correct(answer, item) for item in ground_truth)
    predicted, gold = normalize_answer(answer), normalize_answer(str(ground_truth))
    if predicted == gold:
        return bool(gold)
    a, b = _as_number(predicted), _as_number(gold)
    return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))


def overlong_penalty(
    response_length: int, max_response_length: int | None, overlong_buffer_length: int, overlong_penalty_factor: float
) -> float:
    """The (non-positive) penalty for a response of ``response_length`` tokens."""
    if not max_response_length or overlong_buffer_length <= 0:
        return 0.0
    excess = response_length - (max_response_length - overlong_buffer_length)
    if excess <= 0:
        return 0.0
    return -min(excess / overlong_buffer_length, 1.0) * overlong_penalty_factor


def compute_score(
    reward_input: dict[str, Any],
    max_response_length: int | None = None,
    overlong_buffer_length: int = 0,
    overlong_penalty_factor: float = 1.0,
) -> dict[str, float]:
    """Sequential reward for one input (``response``, ``response_length``, ``ground_truth``)."""
    answer = extract_answer(reward_input["response"])
    correct = answer is not None and is_correct(answer, reward_input["ground_truth"])
    penalty = overlong_penalty(
        int(reward_input.get("response_length", 0)),
        max_response_length,
        overlong_buffer_length,
        overlong_penalty_factor,
    )
    return {"overall": (1.0 if correct else -1.0) + penalty, "accuracy": float(correct), "overlong_penalty": penalty}


main = compute_score
