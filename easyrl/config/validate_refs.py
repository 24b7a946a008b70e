"""Checks of the second models in the loop (a distillation teacher, a judge, a reward model): each failure names the
key and the fix. Called by `easyrl.config.validate.validate`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from easyrl.config.algorithm import DISTILL_MODES
from easyrl.config.errors import ConfigError
from easyrl.config.model_ref import ON_ERROR, ModelRefConfig
from easyrl.config.names import declared_needs


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig


def check_model_ref(ref: ModelRefConfig, key: str) -> None:
    """One model reference: local or remote (not both), sane limits."""
    if ref.local and ref.remote:
        raise ConfigError(
            key, "sets both model_path (a local model) and base_url (a server): keep the one this model is"
        )
    if ref.on_error not in ON_ERROR:
        raise ConfigError(f"{key}.on_error", f"{ref.on_error!r} is not allowed; choose one of: {', '.join(ON_ERROR)}")
    if ref.max_concurrency < 1:
        raise ConfigError(f"{key}.max_concurrency", f"must be >= 1, got {ref.max_concurrency}")
    if ref.timeout_s <= 0:
        raise ConfigError(f"{key}.timeout_s", f"must be > 0 seconds, got {ref.timeout_s}")
    if ref.max_retries < 0:
        raise ConfigError(f"{key}.max_retries", f"must be >= 0 (0: no retry), got {ref.max_retries}")
    if ref.remote and not str(ref.base_url).startswith(("http://", "https://")):
        raise ConfigError(f"{key}.base_url", f"{ref.base_url!r} is not an http(s) URL; e.g. http://localhost:8000/v1")
    if ref.local:
        path = str(ref.model_path)
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{key}.model_path", f"no Hugging Face model folder (config.json) at {path}")
        if ref.tokenizer_path and not Path(ref.tokenizer_path).is_dir():
            raise ConfigError(f"{key}.tokenizer_path", f"folder not found: {ref.tokenizer_path}")


def check_distill(cfg: EasyRLConfig) -> None:
    """`algorithm.distill`: a local teacher, a known mode, a coefficient that is not negative, and a task advantage
    only where one is computed."""
    dist = cfg.algorithm.distill
    key = "algorithm.distill"
    if dist.mode not in DISTILL_MODES:
        raise ConfigError(f"{key}.mode", f"{dist.mode!r} is not allowed; choose one of: {', '.join(DISTILL_MODES)}")
    if dist.coef < 0:
        raise ConfigError(f"{key}.coef", f"must be >= 0 (a negative weight pushes the student away), got {dist.coef}")
    if not dist.enabled:
        return
    check_model_ref(dist.teacher, f"{key}.teacher")
    if dist.teacher.remote:
        raise ConfigError(
            f"{key}.teacher.base_url",
            "a remote teacher is not supported: the teacher's log-prob of every sampled token comes from a forward "
            "pass in a local role; give the teacher's checkpoint as model_path instead",
        )
    if not dist.with_task_reward and declared_needs(cfg.algorithm.adv_estimator).needs_critic:
        raise ConfigError(
            f"{key}.with_task_reward",
            f"false trains on the teacher alone, but {cfg.algorithm.adv_estimator} trains a critic on the task "
            "reward: use an estimator without a critic (grpo, rloo, ...) or keep the task reward",
        )
