"""Configuration of diffusion RL (``worker.rollout.diffusion.*``): how a flow-matching pipeline samples images or
videos, and which of their denoising steps train (docs/diffusion.md).

A run is a diffusion run when `enable` is true, or when it is null and `worker.actor.model.model_path` is a diffusers
pipeline (a folder or hub ID with a ``model_index.json``). Long-RL's ``trainer.diffusion: true`` sets `enable`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


KEY = "worker.rollout.diffusion"
PIPELINE_INDEX = "model_index.json"
"""The file every diffusers pipeline folder has (its components and their classes); a transformers model has none."""


def is_diffusion_pipeline(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` is a diffusers pipeline folder: the detection `DiffusionConfig.enable: null` uses. Hub IDs are
    local folders by the time this runs (`config.hub` resolves them while the config loads), so it never reaches the
    network; a path that does not exist is not a pipeline (the model's own check names it)."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), PIPELINE_INDEX))


@dataclass
class DiffusionConfig:
    enable: bool | None = None
    """Train a diffusion pipeline: null detects it from `worker.actor.model.model_path` (a diffusers pipeline has a
    ``model_index.json``); true requires one; false never treats the model as one."""
    num_steps: int = 10
    """Denoising steps of each sampled image or video during training (the trajectory's length)."""
    val_num_steps: int | None = None
    """Denoising steps at validation; null: `num_steps`."""
    guidance_scale: float = 4.5
    """Classifier-free guidance during sampling and in the update's forward (1.0: off, one forward per step)."""
    noise_level: float = 0.7
    """The SDE sampler's noise scale (Flow-GRPO's a): each step's standard deviation is
    a * sqrt(sigma / (1 - sigma)) * sqrt(step size). 0 would make sampling deterministic and leave no log-probability."""
    train_timestep_fraction: float = 1.0
    """Fraction of each trajectory's steps the update trains on, drawn per trajectory from the rollout seed (Flow-GRPO's
    timestep subsampling); 1.0: every step."""
    height: int = 512
    """Image (or video frame) height in pixels; a multiple of the VAE's scale factor times the patch size."""
    width: int = 512
    """Image (or video frame) width in pixels."""
    num_frames: int = 1
    """Frames per sample: 1 for image pipelines, more for video pipelines (Wan: 4k + 1)."""
    max_sequence_length: int = 256
    """Tokens of the T5-style text encoder (SD3, Wan); prompts are cut to it."""
    negative_prompt: str = ""
    """The unconditional branch's prompt under classifier-free guidance."""
