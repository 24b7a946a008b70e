"""Whether a run trains a diffusion pipeline: read from the root config, so apart from `config.diffusion`'s dataclass
(which `config.worker` imports; a module of both would close an import circle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from easyrl.config.diffusion import diffusion_enabled


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig


def is_diffusion_run(cfg: EasyRLConfig) -> bool:
    """Whether `cfg` trains a diffusion pipeline: `worker.rollout.diffusion.enable`, or when null whether
    `worker.actor.model.model_path` is one (`config.diffusion.diffusion_enabled`)."""
    return diffusion_enabled(cfg.worker.rollout.diffusion.enable, cfg.worker.actor.model.model_path)
