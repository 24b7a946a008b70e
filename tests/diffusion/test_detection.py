"""`easyrl.config.diffusion_run.is_diffusion_run`: a diffusers folder (its model_index.json) makes
a run a diffusion run unless `worker.rollout.diffusion.enable` says otherwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from easyrl.config.diffusion import DiffusionConfig
from easyrl.config.diffusion_run import is_diffusion_run


def config(model_path: str, enable: bool | None) -> Any:
    """The two keys `is_diffusion_run` reads, shaped as the config's sections."""
    rollout = SimpleNamespace(diffusion=DiffusionConfig(enable=enable))
    actor = SimpleNamespace(model=SimpleNamespace(model_path=model_path))
    return SimpleNamespace(worker=SimpleNamespace(rollout=rollout, actor=actor))


def test_enable_overrides_the_detection_either_way(tmp_path: Path, tiny_model_dir: str) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert is_diffusion_run(config(str(tmp_path), None)) and not is_diffusion_run(config(tiny_model_dir, None))
    assert not is_diffusion_run(config(str(tmp_path), False)) and is_diffusion_run(config(tiny_model_dir, True))


def test_validation_samples_with_val_num_steps_or_else_num_steps(tmp_path: Path, tiny_model_dir: str) -> None:
    """What validation changes in the sampling (`role_specs.validation_sampling`): a diffusion run's denoising steps
    are `val_num_steps`, null meaning `num_steps`; a text run gets no such key (its engines have no steps)."""
    from easyrl.config import EasyRLConfig
    from easyrl.rollout.engine import SamplingParams
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import validation_sampling

    (tmp_path / "model_index.json").write_text("{}")
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = str(tmp_path)
    cfg.worker.rollout.diffusion.num_steps = 6
    assert validation_sampling(cfg, plan_of(cfg)) == {"logprobs": False, "denoising_steps": 6}
    cfg.worker.rollout.diffusion.val_num_steps = 3
    changes = validation_sampling(cfg, plan_of(cfg))
    assert changes == {"logprobs": False, "denoising_steps": 3}
    assert SamplingParams().override(changes).denoising_steps == 3
    cfg.worker.actor.model.model_path = tiny_model_dir
    assert validation_sampling(cfg, plan_of(cfg)) == {"logprobs": False}
