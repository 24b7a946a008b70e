"""R1-V style reward: ``<think>...</think>`` then ``<answer>...</answer>``, and a correct answer.

Scores (each 0 or 1): ``format`` = the whole response is ``<think>...</think>`` followed by
``<answer>...</answer>`` (whitespace allowed around them); ``accuracy`` = the content of the last
``<answer>...</answer>`` (or of a ``\\boxed{}`` inside it) matches the ground truth: math-verify first, then a
normalized string comparison (case, spaces, ``$`` and a final period ignored), so multiple-choice letters and short
phrases work too. ``overall = (1 - format_weight) * accuracy + format_weight * format`` with ``format_weight = 0.5``
by default.

Use with ``prompt_templates/r1v.jinja``::

    worker.reward.reward_function=reward_functions/r1v.py:compute_score
"""

from __future__ import annotations

import re
import threading
from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "r1v"

FORMAT_PATTERN = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED_PATTERN = re.compile(r"\\boxed\{(.*)\}", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """Content of the last ``<answer>...</answer>``, unwrapped from a ``\\boxed{}`` if it has one."""
    matches = ANSWER_PATTERN.findall(response)
    if not matches:
        return None
    answer = matches[-1].strip()
    boxed = BOXED_PATTERN.search(answer)
    return boxed.group(1).strip() if boxed else answer


def normalize(text: str) -> str:
    """Lower-cased, without spaces, ``$``, ``\\text{}`` wrappers or a final period."""
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text.strip())
    return re.sub(r"\s+", "", text).strip("$").rstrip(".").lower()


def is_correct(answer: str, ground_truth: Any) -> bool:
    """Whether ``answer`` matches ``ground_truth`` (a list: any of its items)."""
    if isinstance(ground_truth, list | tuple):
        return any(is_correct(answer, item) for item in ground_truth)
    gold_text = str(ground_truth).strip()
    if not gold_text:
        return False
    if normalize(answer) == normalize(gold_text):
        return True
    try:
        from math_verify import parse, verify

        # SIGALRM-based timeouts only work in the main thread.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold = parse(f"${gold_text.strip('$')}$", parsing_timeout=timeout)
        parsed = parse(f"${answer.strip('$')}$", parsing_timeout=timeout)
        return bool(gold and parsed and verify(gold, parsed, timeout_seconds=timeout))
    except Exception:  # unparseable text already failed the string comparison
        return False


def score_one(response: str, ground_truth: Any, format_weight: float = 0.5) -> dict[str, float]:
    """Scores of one response."""
    format_score = 1.0 if FORMAT_PATTERN.match(response) else 0.0
    answer = extract_answer(response)
    accuracy = 1.0 if answer and is_correct(answer, ground_truth) else 0.0
    return {
        "overall": (1.0 - format_weight) * accuracy + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy,
    }


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.5) -> list[dict[str, float]]:
    """Batch reward: one ``{overall, format, accuracy}`` per input (``response``, ``ground_truth``)."""
    return [score_one(item["response"], item["ground_truth"], format_weight) for item in reward_inputs]


main = compute_score
