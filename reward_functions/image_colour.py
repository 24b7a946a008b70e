"""A verifiable image reward: how much of each sampled image is the colour its prompt names.

Diffusion batch contract (docs/diffusion.md): `compute_score(reward_inputs)` takes a list of dicts, each the data row
plus `prompt` (the rendered prompt), `ground_truth` and `image`, the decoded sample as an H x W x 3 uint8 numpy array
(RGB); a video pipeline's inputs also carry `video`, its F x H x W x 3 frames, which are scored instead. It returns
one dict of scores per input. (reward_functions/colour.py is the CPU demo's reward: red/green/blue by channel margin.)

Scores, all in [0, 1]:

- `colour_share`: the mean over pixels (and frames) of a soft match to the named colour: 1 - (distance to the colour's
  RGB) / sqrt(3), so an exact pixel scores 1 and the opposite corner of the RGB cube 0;
- `overall`: `colour_share`. A prompt naming no known colour scores 0 with `named` = 0 (counted, never skipped).
"""

from __future__ import annotations

from typing import Any

import numpy as np


REWARD_TYPE = "batch"
REWARD_NAME = "image_colour"

COLOURS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
}


def score_one(pixels: np.ndarray, prompt: str) -> dict[str, float]:
    """Score one sample's pixels (H x W x 3 or F x H x W x 3, uint8 RGB) against the first colour its prompt names."""
    if pixels.ndim not in (3, 4) or pixels.shape[-1] != 3:
        raise ValueError(f"image_colour: expected H x W x 3 (or F x H x W x 3) RGB, got shape {tuple(pixels.shape)}")
    words = [w.strip(".,!?;:") for w in prompt.lower().split()]
    named = next((COLOURS[w] for w in words if w in COLOURS), None)
    if named is None:
        return {"overall": 0.0, "colour_share": 0.0, "named": 0.0}
    rgb = pixels.astype(np.float64) / 255.0
    distance = np.sqrt(((rgb - np.asarray(named)) ** 2).sum(axis=-1))
    share = float((1 - distance / 3**0.5).mean())
    return {"overall": share, "colour_share": share, "named": 1.0}


def compute_score(reward_inputs: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, float]]:
    """Score a batch of decoded samples (other keyword arguments are accepted and ignored)."""
    return [
        score_one(np.asarray(item["video"] if "video" in item else item["image"]), str(item.get("prompt", "")))
        for item in reward_inputs
    ]
