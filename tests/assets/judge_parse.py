"""A judge parse function for tests: a tiny random judge model writes no rubric, so the score is read from the shape
of its reply (its length, capped at 10, over 10): deterministic, and different for different replies."""

from __future__ import annotations


def length_score(text: str) -> float | None:
    """None (unreadable) for an empty reply, else min(len(text), 10) / 10."""
    return min(len(text), 10) / 10 if text else None
