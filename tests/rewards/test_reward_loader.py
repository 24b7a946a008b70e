"""load_reward_function: spec parsing, attributes, kwargs binding and errors naming file and function."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.rewards import RewardLoadError, load_reward_function
from easyrl.rewards.loader import parse_reward_spec


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_parse_spec() -> None:
    assert parse_reward_spec("a/b.py:score") == ("a/b.py", "score")
    assert parse_reward_spec("a/b.py") == ("a/b.py", "main")
    assert parse_reward_spec("a/b.py:") == ("a/b.py:", "main")


def test_defaults_attributes_and_kwargs(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "my_reward.py",
        "import math\n"  # the stdlib, even though a reward file may be called math.py
        "def main(x, scale=1.0, api_key=None):\n    return [{'overall': scale * math.sqrt(4)} for _ in x]\n"
        "def other(x):\n    return x\n",
    )
    reward = load_reward_function(path, {"scale": 3.0, "api_key": "SECRET"}, reward_type="batch")
    assert reward.name == "my_reward.py:main"
    assert (reward.reward_type, reward.reward_name, reward.is_async) == ("batch", "main", False)
    assert reward.fn([{}]) == [{"overall": 6.0}]
    assert "SECRET" not in repr(reward)  # kwargs may hold secrets
    seq = load_reward_function(f"{path}:other", reward_type="sequential")
    assert seq.reward_type == "sequential" and seq.reward_name == "other"


def test_module_attributes_win_and_async_detected(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "attrs.py",
        "REWARD_TYPE = 'sequential'\nREWARD_NAME = 'judge'\nasync def score(x):\n    return 1.0\n",
    )
    reward = load_reward_function(f"{path}:score", {}, reward_type="batch")
    assert (reward.reward_type, reward.reward_name, reward.is_async) == ("sequential", "judge", True)


def test_same_file_name_twice_does_not_collide(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = load_reward_function(_write(tmp_path / "a" / "r.py", "def main(x):\n    return 'a'\n"))
    second = load_reward_function(_write(tmp_path / "b" / "r.py", "def main(x):\n    return 'b'\n"))
    assert (first.fn(None), second.fn(None)) == ("a", "b")


def test_errors_name_file_and_function(tmp_path: Path) -> None:
    missing = tmp_path / "missing.py"
    with pytest.raises(RewardLoadError, match=f"reward file not found: {missing}"):
        load_reward_function(f"{missing}:main")
    broken = _write(tmp_path / "broken.py", "import os\nfrom not_a_real_module_xyz.grader import grade\n")
    with pytest.raises(RewardLoadError) as info:
        load_reward_function(broken)
    assert str(info.value) == (
        f"reward file {broken} imports 'not_a_real_module_xyz', which is not installed: pip install not_a_real_module_xyz"
    )
    cv = _write(tmp_path / "cv.py", "import cv2.data\n")
    with pytest.raises(RewardLoadError, match=r"imports 'cv2', which is not installed: pip install opencv-python$"):
        load_reward_function(cv)
    syntax = _write(tmp_path / "syntax.py", "def main(:\n")
    with pytest.raises(RewardLoadError, match=r"syntax\.py failed to import: SyntaxError"):
        load_reward_function(syntax)
    defs = _write(tmp_path / "defs.py", "def alpha(x):\n    pass\ndef beta(x):\n    pass\nVALUE = 3\n")
    with pytest.raises(RewardLoadError, match=r"defs\.py has no function 'gamma'; it defines: alpha, beta"):
        load_reward_function(f"{defs}:gamma")
    with pytest.raises(RewardLoadError, match=r"defs\.py: 'VALUE' is a int, not a function"):
        load_reward_function(f"{defs}:VALUE")
    bad_type = _write(tmp_path / "bad_type.py", "REWARD_TYPE = 'parallel'\ndef main(x):\n    pass\n")
    with pytest.raises(RewardLoadError, match="reward type 'parallel'"):
        load_reward_function(bad_type)


def test_easyr1_style_math_reward_with_mathruler(tmp_path: Path) -> None:
    """EasyR1's math reward files import mathruler: it is a dependency, so such a file loads and scores."""
    path = _write(
        tmp_path / "math.py",
        "from mathruler.grader import extract_boxed_content, grade_answer\n"
        "def compute_score(reward_inputs):\n"
        "    return [{'overall': float(grade_answer(extract_boxed_content(x['response']), x['ground_truth']))}\n"
        "            for x in reward_inputs]\n",
    )
    reward = load_reward_function(f"{path}:compute_score")
    inputs = [
        {"response": "so \\boxed{\\frac{1}{2}}", "ground_truth": "0.5"},
        {"response": "\\boxed{3}", "ground_truth": "4"},
    ]
    assert reward.fn(inputs) == [{"overall": 1.0}, {"overall": 0.0}]
