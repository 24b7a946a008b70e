"""Configuration of diffusion RL (``worker.rollout.diffusion.*``): how a flow-matching pipeline samples images or
videos, and which of their denoising steps train (docs/diffusion.md).

A run is a diffusion run when `enable` is true, or when it is null and `worker.actor.model.model_path` is a diffusers
pipeline (a folder or hub ID with a ``model_index.json``). Long-RL's ``trainer.diffusion: true`` sets `enable`.
"""

from __future__ import annotations

from dataclasses import dataclass


KEY = "worker.rollout.diffusion"


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


def is_diffusion_pipeline(path: str | None) -> bool:
    """True when `path` is a diffusers pipeline: a folder with a ``model_index.json``, or a hub ID whose
    ``model_index.json`` is already in the local Hugging Face cache (detection never downloads)."""
    import os

    if not path:
        return False
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "model_index.json"))
    from easyrl.config.hub import hub_cache_dir, is_hub_id

    if not is_hub_id(path):
        return False
    from huggingface_hub import try_to_load_from_cache

    # Only the cache is read: a hub ID not fetched yet is resolved (and detected) after `resolve_hub_ids`.
    found = try_to_load_from_cache(path, "model_index.json", cache_dir=hub_cache_dir())
    return isinstance(found, str)
