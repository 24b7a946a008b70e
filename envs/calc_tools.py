"""Calculator tools as plain functions: `worker.rollout.multi_turn.tools: envs/calc_tools.py`.

Each public function is a tool; its schema comes from the type hints and the docstring's `Args:` lines. Without an
environment the prompt is the dataset's own.
"""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b
