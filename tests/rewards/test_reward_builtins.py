"""The shipped reward functions (reward_functions/*.py) on hand-written responses, and their templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from easyrl.rewards import load_reward_function


ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, **kwargs: Any) -> Any:
    return load_reward_function(str(ROOT / "reward_functions" / f"{name}.py"), kwargs)


def test_math_boxed_extraction_and_scores() -> None:
    reward = _load("math")
    assert (reward.reward_type, reward.reward_name, reward.function_name) == ("batch", "math", "main")
    module_fn = reward.fn.func.__globals__["last_boxed"]
    assert module_fn(r"a \boxed{1} then \boxed{\frac{x^{2}}{\{y\}}} end") == r"\frac{x^{2}}{\{y\}}"
    assert module_fn(r"\boxed 7 done") == "7"
    assert module_fn(r"\fbox{3}") == "3"
    assert module_fn(r"\boxed{unclosed") is None
    assert module_fn("no box") is None
    inputs = [
        {"response": r"Thus \boxed{\frac{1}{2}}.", "ground_truth": "0.5"},  # equivalent form
        {"response": r"The answer is \boxed{3}", "ground_truth": "4"},  # wrong
        {"response": "The answer is 4", "ground_truth": "4"},  # no box
        {"response": r"\boxed{x+1}", "ground_truth": ["1+x", "y"]},  # any of a list
        {"response": r"\boxed{\text{blue}}", "ground_truth": "blue"},  # string fallback
    ]
    scores = reward.fn(inputs)
    assert [s["accuracy"] for s in scores] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert [s["format"] for s in scores] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert scores[0]["overall"] == pytest.approx(1.0)
    assert scores[1]["overall"] == pytest.approx(0.1)
    assert scores[2]["overall"] == 0.0
    weighted = _load("math", format_weight=0.5).fn(inputs[1:2])
    assert weighted[0]["overall"] == pytest.approx(0.5)


def test_r1v_format_and_accuracy() -> None:
    reward = _load("r1v")
    assert reward.reward_type == "batch" and reward.reward_name == "r1v"
    inputs = [
        {"response": "<think>count</think>\n<answer>B</answer>", "ground_truth": "b"},
        {"response": "<think>t</think><answer>\\frac{1}{2}</answer>", "ground_truth": "0.5"},
        {"response": "<answer>7</answer>", "ground_truth": "7"},  # no think: format 0
        {"response": "<think>t</think><answer>6</answer>", "ground_truth": "7"},
        {"response": "<think>t</think><answer>\\boxed{12}</answer> trailing text", "ground_truth": "12"},
        {"response": "just 7", "ground_truth": "7"},
    ]
    scores = reward.fn(inputs)
    assert [s["format"] for s in scores] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [s["accuracy"] for s in scores] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert [s["overall"] for s in scores] == [1.0, 1.0, 0.5, 0.5, 0.5, 0.0]


def test_dapo_answer_line_and_overlong_penalty() -> None:
    reward = _load("dapo", max_response_length=100, overlong_buffer_length=20, overlong_penalty_factor=1.0)
    assert reward.reward_type == "sequential" and reward.reward_name == "dapo"

    def score(response: str, truth: Any, length: int = 10) -> dict[str, float]:
        return reward.fn({"response": response, "response_length": length, "ground_truth": truth})

    assert score("work...\nAnswer: 1,000", "1000") == {"overall": 1.0, "accuracy": 1.0, "overlong_penalty": 0.0}
    assert score("Answer: 5\nwait, no.\nAnswer: $\\boxed{12}$", "12")["accuracy"] == 1.0
    assert score("Answer: 3.0", 3)["accuracy"] == 1.0
    assert score("Answer: 4", "5")["overall"] == -1.0
    assert score("no answer line", "5")["overall"] == -1.0
    assert score("Answer: 12", "12", length=80)["overall"] == 1.0  # at the buffer's start: no penalty
    assert score("Answer: 12", "12", length=90)["overall"] == pytest.approx(0.5)
    assert score("Answer: 11", "12", length=100)["overall"] == pytest.approx(-2.0)
    no_penalty = _load("dapo")
    assert no_penalty.fn({"response": "Answer: 1", "response_length": 10**6, "ground_truth": "1"})["overall"] == 1.0


@pytest.mark.parametrize(
    ("name", "expected"),
    [("math", "\\boxed{}"), ("r1v", "<answer>"), ("dapo", "Answer: $Answer")],
)
def test_prompt_templates_render_content(name: str, expected: str) -> None:
    text = (ROOT / "prompt_templates" / f"{name}.jinja").read_text(encoding="utf-8")
    rendered = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text).render(content="What is 2+2?")
    assert "What is 2+2?" in rendered
    assert expected in rendered
