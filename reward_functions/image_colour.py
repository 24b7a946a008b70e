"""A verifiable image reward: how much of each sampled image is the colour its prompt names.

Diffusion batch contract (docs/diffusion.md): `compute_score(reward_inputs)` takes a list of dicts, each the data row
plus `prompt` (the rendered prompt) and `images`, a float tensor (F, 3, H, W) in [0, 1] (F = 1 for an image, the
frames of a video), and returns one dict of scores per input.

Scores, all in [0, 1]:

- `colour_share`: the mean over pixels (and frames) of a soft match to the named colour: 1 - (distance to the colour's
  RGB) / sqrt(3), so an exact pixel scores 1 and the opposite corner of the RGB cube 0;
- `overall`: `colour_share`. A prompt naming no known colour scores 0 with `named` = 0 (counted, never skipped).
"""

from __future__ import annotations

from typing import Any

import torch


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


def score_one(images: torch.Tensor, prompt: str) -> dict[str, float]:
    """Score one sample's frames (F, 3, H, W) in [0, 1] against the first colour its prompt names."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (frames, 3, height, width), got {tuple(images.shape)}")
    words = [w.strip(".,!?;:") for w in prompt.lower().split()]
    named = next((COLOURS[w] for w in words if w in COLOURS), None)
    if named is None:
        return {"overall": 0.0, "colour_share": 0.0, "named": 0.0}
    target = torch.tensor(named, dtype=images.dtype).view(1, 3, 1, 1)
    distance = (images.clamp(0, 1) - target).pow(2).sum(dim=1).sqrt()  # (F, H, W)
    share = float((1 - distance / 3**0.5).mean())
    return {"overall": share, "colour_share": share, "named": 1.0}


def compute_score(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [score_one(item["images"], str(item.get("prompt", ""))) for item in reward_inputs]
