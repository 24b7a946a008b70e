"""Math reward: the last ``\\boxed{...}`` of the response checked against the ground truth with math-verify.

Scores (each 0 or 1): ``format`` = the response has a complete ``\\boxed{...}``; ``accuracy`` = its content is
mathematically equivalent to the ground truth (math-verify, falling back to a normalized string comparison when
either side cannot be parsed). ``overall = (1 - format_weight) * accuracy + format_weight * format`` with
``format_weight = 0.1`` by default (set it with ``worker.reward.reward_function_kwargs: {format_weight: ...}``).

Use with ``prompt_templates/math.jinja``::

    worker.reward.reward_function=reward_functions/math.py:compute_score
"""

from __future__ import annotations

import re
import threading
from typing import Any


REWARD_TYPE = "batch"
REWARD_NAME = "math"

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included.

    ``\\boxed 5`` (no braces) gives ``5``. An unclosed last box (a truncated response) gives ``None``.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    pos = after = start + len(command)
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        if pos == after:
            return None  # e.g. "\boxedx": not a box command
        # "\boxed 5": the argument is the next token.
        match = re.match(r"[^\s$]+", text[pos:])
        return match.group(0) if match else None
    depth = 0
    for end in range(pos, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : end].strip()
    return None


def _normalize(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    text = re.sub(r"(\d),(\d{3})", r"\1\2", text)
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only works in the main thread; elsewhere run without a timeout.
    return 5 if threading.current_thread() is threading.main_thread() else None


def is_equivalent(prediction: str, ground_truth: Any) -> bool:
    """Whether ``prediction`` matches ``ground_truth`` (a list: any of its items)."""
    if isinstance(ground_truth, list | tuple):
        return any(is_equivalent(prediction, item) for item in ground_truth)
    gold_text = str(ground_truth).strip()
    if not gold_text:
        return False
    try:
        from math_verify import parse, verify

        timeout = _timeout()
        gold_latex = gold_text if ("$" in gold_text or "\\boxed" in gold_text) else f"${gold_text}$"
        gold = parse(gold_latex, parsing_timeout=timeout)
        answer = parse(f"\\boxed{{{prediction}}}", parsing_timeout=timeout)
        if gold and answer and verify(gold, answer, timeout_seconds=timeout):
            return True
    except Exception:  # math-verify failing on odd input is not a wrong answer by itself; fall back
        pass
    return _normalize(prediction) == _normalize(gold_text)


def score_one(response: str, ground_truth: Any, format_weight: float = 0.1) -> dict[str, float]:
    """Scores of one response."""
    boxed = last_boxed(response)
    format_score = 1.0 if boxed is not None else 0.0
    accuracy = 1.0 if boxed and is_equivalent(boxed, ground_truth) else 0.0
    return {
        "overall": (1.0 - format_weight) * accuracy + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy,
    }


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    """Batch reward: one ``{overall, format, accuracy}`` per input (``response``, ``ground_truth``)."""
    return [score_one(item["response"], item["ground_truth"], format_weight) for item in reward_inputs]


main = compute_score
