"""reward_functions/colour.py, the diffusion demo's reward: the named colour's margin over the other channels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from easyrl.rewards import load_reward_function


ROOT = Path(__file__).resolve().parents[2]


def image(rgb: tuple[int, int, int], size: int = 4) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (size, size, 3)).copy()


def test_scores_by_hand() -> None:
    fn = load_reward_function(str(ROOT / "reward_functions" / "colour.py"))
    half = image((0, 0, 255))
    half[:2] = (255, 0, 0)  # top half red, bottom half blue
    scores = fn.fn([{"image": image((200, 50, 100)), "ground_truth": "red"}, {"image": half, "ground_truth": "Red"}])
    assert scores[0] == pytest.approx({"overall": (1 + 100 / 255) / 2, "margin": 100 / 255, "share": 1.0})
    # margin: half the pixels +1 (255 over 0), half -1 (0 under 255): 0; share 0.5
    assert scores[1] == pytest.approx({"overall": 0.5, "margin": 0.0, "share": 0.5})


def test_an_unknown_colour_or_a_non_image_is_one_line_naming_it() -> None:
    fn = load_reward_function(str(ROOT / "reward_functions" / "colour.py"))
    with pytest.raises(ValueError, match="ground_truth 'purple' is not one of red, green, blue"):
        fn.fn([{"image": image((1, 2, 3)), "ground_truth": "purple"}])
    with pytest.raises(ValueError, match=r"expected an H x W x 3 image, got shape \(4, 4\)"):
        fn.fn([{"image": np.zeros((4, 4), dtype=np.uint8), "ground_truth": "red"}])


def test_brightness_is_the_mean_pixel() -> None:
    fn = load_reward_function(str(ROOT / "reward_functions" / "colour.py") + ":brightness")
    scores = fn.fn([{"image": image((255, 0, 0))}, {"image": image((51, 51, 51))}])
    assert scores == [pytest.approx({"overall": 1 / 3}), pytest.approx({"overall": 0.2})]
