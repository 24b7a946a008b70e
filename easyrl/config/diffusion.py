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
    from easyrl.config.hub_paths import hub_cache_dir, is_hub_id

    if not is_hub_id(path):
        return False
    from huggingface_hub import try_to_load_from_cache

    # Only the cache is read: a hub ID not fetched yet is resolved (and detected) after `resolve_hub_ids`.
    found = try_to_load_from_cache(path, "model_index.json", cache_dir=hub_cache_dir())
    return isinstance(found, str)


# Long-RL (NVlabs/Long-RL) marks a diffusion run with `diffusion: true` in five sections and spreads the sampler's
# settings over the rollout, actor and ref sections. Its keys -> ours; docs/diffusion.md has the table.
LONGRL_FLAGS = (
    "trainer.diffusion",
    "data.diffusion",
    "worker.actor.diffusion",
    "worker.ref.diffusion",
    "worker.reward.diffusion",
    "worker.rollout.diffusion",  # a bool there is Long-RL's flag; a mapping is our section
)
LONGRL_RENAMES = {
    "worker.rollout.guidance_scale": (f"{KEY}.guidance_scale",),
    "worker.actor.guidance_scale": (f"{KEY}.guidance_scale",),
    "worker.ref.guidance_scale": (f"{KEY}.guidance_scale",),
    "worker.rollout.num_steps": (f"{KEY}.num_steps",),
    "worker.rollout.resolution": (f"{KEY}.height", f"{KEY}.width"),
    "worker.rollout.height": (f"{KEY}.height",),
    "worker.rollout.width": (f"{KEY}.width",),
    "worker.rollout.num_frames": (f"{KEY}.num_frames",),
}
# Long-RL keys with a value easyrl has built in: accepted at that value (with a note), refused at any other.
LONGRL_BUILT_IN = {
    "worker.rollout.kl_reward": (
        0.0,
        "Long-RL's KL-as-reward during sampling is not supported; keep it 0 and use algorithm.use_kl_loss=true with "
        "algorithm.kl_coef (the closed-form KL of each transition to the reference's)",
    ),
    "algorithm.kl_penalty": (
        "flow_grpo",
        "",  # any other value is an LLM estimator and goes through the usual check
    ),
    "worker.actor.kl_penalty": (
        "flow_grpo",
        "is set by algorithm.kl_penalty; remove it",
    ),
}


def _sets_size(flat: dict[str, object]) -> bool:
    return any(f"{section}.{side}" in flat for section in ("worker.rollout", KEY) for side in ("height", "width"))


# Long-RL keys its diffusion configs carry that easyrl derives elsewhere: accepted, ignored, and reported.
LONGRL_IGNORED = {
    "worker.actor.scheduler": "the scheduler comes from the pipeline folder",
    "worker.ref.scheduler": "the scheduler comes from the pipeline folder",
    "worker.ref.ulysses_size": "the reference follows worker.actor.ulysses_size",
}


def translate_longrl_keys(flat: dict[str, object], notes: list[str]) -> dict[str, object]:
    """`flat` (dotted keys -> values, as the user wrote them) with Long-RL's diffusion keys translated onto
    ``worker.rollout.diffusion.*``; each translation is noted, a key with no equivalent raises `ConfigError`."""
    from easyrl.config.errors import ConfigError

    flags = {key: flat[key] for key in LONGRL_FLAGS if isinstance(flat.get(key), bool)}
    out: dict[str, object] = {}
    if flags:
        # Long-RL's `false` means "an LLM run": here that is what detection finds for a model that is no pipeline.
        enable = True if any(flags.values()) else None
        if flat.get(f"{KEY}.enable") not in (None, enable):
            raise ConfigError(f"{KEY}.enable", f"Long-RL's {', '.join(flags)} say otherwise: keep one")
        if enable:
            out[f"{KEY}.enable"] = True
        notes.append(f"{', '.join(flags)}: Long-RL's diffusion flag; using {KEY}.enable={enable}")
    for key, value in flat.items():
        if key in flags:
            continue
        if key == "worker.rollout.resolution" and _sets_size(flat):
            # Long-RL's video sampler reads height and width and leaves `resolution` (an image key) at its default
            notes.append(f"{key} is Long-RL's image size; the config sets height and width, which win; ignored")
        elif key in LONGRL_RENAMES:
            for new in LONGRL_RENAMES[key]:
                if out.get(new, value) != value or flat.get(new, value) != value:
                    raise ConfigError(key, f"is Long-RL's name for {new}, which is set to another value: keep one")
                out[new] = value
            notes.append(f"{key} is Long-RL's name for {' and '.join(LONGRL_RENAMES[key])}; using it")
        elif key in LONGRL_IGNORED:
            notes.append(f"{key} is a Long-RL key: {LONGRL_IGNORED[key]}; ignored")
        elif key in LONGRL_BUILT_IN and value == LONGRL_BUILT_IN[key][0]:
            notes.append(f"{key}={value} is Long-RL's; a diffusion run's KL is the closed-form Gaussian one; ignored")
        elif key in LONGRL_BUILT_IN and LONGRL_BUILT_IN[key][1]:
            raise ConfigError(key, LONGRL_BUILT_IN[key][1])
        else:
            out.setdefault(key, value)
    return out


def diffusion_enabled(enable: bool | None, model_path: str | None) -> bool:
    """Whether a run trains a diffusion pipeline: `enable`, or when null, what `model_path` is."""
    return enable if enable is not None else is_diffusion_pipeline(model_path)


def read_config_json(path: str) -> dict[str, object]:
    import json

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    assert isinstance(data, dict), path
    return data


def pipeline_geometry(path: str) -> tuple[str, int, int | None, int]:
    """(pipeline class, pixels per latent cell, frames per latent frame or None for an image pipeline, transformer
    patch size) of the diffusers folder at `path`, read from its configs the way diffusers' pipelines read them."""
    import os

    name = str(read_config_json(os.path.join(path, "model_index.json")).get("_class_name", ""))
    vae_file = os.path.join(path, "vae", "config.json")
    vae = read_config_json(vae_file) if os.path.isfile(vae_file) else {}
    tr_file = os.path.join(path, "transformer", "config.json")
    patch_cfg = read_config_json(tr_file).get("patch_size", 2) if os.path.isfile(tr_file) else 2
    # Wan's patch is (frames, height, width); SD3's one int for both sides.
    patch = int(patch_cfg[-1]) if isinstance(patch_cfg, list) else int(str(patch_cfg))
    if "scale_factor_spatial" in vae:  # a video VAE (Wan): its scale factors are in its config
        return name, int(str(vae["scale_factor_spatial"])), int(str(vae.get("scale_factor_temporal", 4))), patch
    blocks = vae.get("block_out_channels", [0, 0, 0, 0])
    assert isinstance(blocks, list), vae_file
    return name, 2 ** (len(blocks) - 1), None, patch


def check_diffusion(cfg: DiffusionConfig, model_path: str | None) -> None:
    """Raise `ConfigError` for the first bad ``worker.rollout.diffusion`` value, naming the key and the fix; a
    config that trains no pipeline (detected or disabled) is not checked."""
    from easyrl.config.errors import ConfigError

    if cfg.enable and not is_diffusion_pipeline(model_path):
        raise ConfigError(
            f"{KEY}.enable",
            f"is true but worker.actor.model.model_path ({model_path}) has no model_index.json: give a diffusers "
            "pipeline folder or hub ID, or set it to null",
        )
    if not diffusion_enabled(cfg.enable, model_path):
        return
    assert model_path is not None
    for key, value in (("num_steps", cfg.num_steps), ("max_sequence_length", cfg.max_sequence_length)):
        if value < 1:
            raise ConfigError(f"{KEY}.{key}", f"must be at least 1, got {value}")
    if cfg.val_num_steps is not None and cfg.val_num_steps < 1:
        raise ConfigError(f"{KEY}.val_num_steps", f"must be at least 1 (or null: num_steps), got {cfg.val_num_steps}")
    if not cfg.noise_level > 0:
        raise ConfigError(
            f"{KEY}.noise_level",
            f"must be > 0 (0 samples deterministically: no log-probability), got {cfg.noise_level}",
        )
    if not 0 < cfg.train_timestep_fraction <= 1:
        raise ConfigError(f"{KEY}.train_timestep_fraction", f"must be in (0, 1], got {cfg.train_timestep_fraction}")
    if cfg.guidance_scale < 1:
        raise ConfigError(f"{KEY}.guidance_scale", f"must be >= 1 (1.0: no guidance), got {cfg.guidance_scale}")
    name, spatial, temporal, patch = pipeline_geometry(model_path)
    step = spatial * patch
    for key, value in (("height", cfg.height), ("width", cfg.width)):
        if value < step or value % step:
            fixed = max(step, value - value % step)
            raise ConfigError(
                f"{KEY}.{key}",
                f"{value} is not a multiple of {step} ({name}: VAE scale {spatial} x patch {patch}); use {fixed}",
            )
    if temporal is None and cfg.num_frames != 1:
        raise ConfigError(f"{KEY}.num_frames", f"{name} makes images: set it to 1, got {cfg.num_frames}")
    if temporal is not None and (cfg.num_frames < 1 or (cfg.num_frames - 1) % temporal):
        fixed = max(1, cfg.num_frames - (cfg.num_frames - 1) % temporal)
        raise ConfigError(
            f"{KEY}.num_frames", f"{name} needs {temporal}k + 1 frames, got {cfg.num_frames}; use {fixed}"
        )
