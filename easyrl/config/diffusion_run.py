"""Whether a run trains a diffusion pipeline: read from the root config, so apart from `config.diffusion`'s dataclass
(which `config.worker` imports; a module of both would close an import circle)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from easyrl.config.diffusion import diffusion_enabled


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig


def is_diffusion_run(cfg: EasyRLConfig) -> bool:
    """Whether `cfg` trains a diffusion pipeline: `worker.rollout.diffusion.enable`, or when null whether
    `worker.actor.model.model_path` is one (`config.diffusion.diffusion_enabled`)."""
    return diffusion_enabled(cfg.worker.rollout.diffusion.enable, cfg.worker.actor.model.model_path)


PLAIN_PROMPT = "{{ messages[-1]['content'] }}"
"""The chat template of a diffusion run: the prompt's text alone (after `data.format_prompt`), as the pipeline encodes
it; a text-to-image model has no conversation format."""


def apply_diffusion_defaults(cfg: EasyRLConfig) -> None:
    """A diffusion run's defaults: the `diffusers` engine where `worker.rollout.name` is left at its (text) default;
    and where the config leaves them null, the pipeline's own tokenizer (its ``tokenizer`` folder; the data section
    counts `data.max_prompt_length` in its tokens) and `PLAIN_PROMPT` as the chat template. Another text engine named
    explicitly is refused by `config.engines.check_engine_capabilities`."""
    from easyrl.config.worker import RolloutConfig

    if not is_diffusion_run(cfg):
        return
    if cfg.worker.rollout.name == RolloutConfig.name:
        cfg.worker.rollout.name = "diffusers"
    model = cfg.worker.actor.model
    if model.tokenizer_path is None and model.model_path:
        model.tokenizer_path = os.path.join(model.model_path, "tokenizer")
    if cfg.data.override_chat_template is None:
        cfg.data.override_chat_template = PLAIN_PROMPT
