"""Checks on a built config, before any worker starts: each failure names the key and the fix."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from easyrl.config.backend import BACKENDS, inline_blockers
from easyrl.config.diffusion import check_diffusion, diffusion_enabled
from easyrl.config.engine_kwargs import check_engine_kwargs
from easyrl.config.engines import check_engine_capabilities, declared_engines
from easyrl.config.errors import ConfigError
from easyrl.config.multi_turn import check_multi_turn
from easyrl.config.names import (
    KL_PENALTY_KINDS,
    LOSS_AGG_MODES,
    declared_estimators,
    declared_needs,
    declared_policy_losses,
)
from easyrl.models.family import FAMILIES, UnknownFamilyError, family_of


if TYPE_CHECKING:
    from easyrl.config.algorithm import RolloutCorrectionConfig
    from easyrl.config.schema import EasyRLConfig
    from easyrl.config.worker import LoraConfig

LOGGERS = ("console", "file", "tensorboard", "wandb", "swanlab", "mlflow")
_ENUMS: dict[str, tuple[str, ...]] = {
    "worker.reward.reward_type": ("batch", "sequential"),
    "algorithm.kl_type": ("fixed", "adaptive"),
    "worker.actor.optim.strategy": ("adamw", "adamw_bf16"),
    "worker.critic.optim.strategy": ("adamw", "adamw_bf16"),
    "worker.actor.optim.lr_scheduler_type": ("constant", "cosine"),
    "worker.critic.optim.lr_scheduler_type": ("constant", "cosine"),
    "worker.rollout.dtype": ("bf16", "fp16", "fp32"),
    "worker.actor.fsdp.mp_param_dtype": ("bf16", "fp16", "fp32"),
    "worker.actor.fsdp.mp_reduce_dtype": ("bf16", "fp16", "fp32"),
    "data.on_bad_row": ("drop", "error"),
    "trainer.device": ("auto", "cuda", "cpu"),
    "trainer.backend": BACKENDS,
    "worker.actor.fused_head_kernel": ("torch", "triton"),
}


def _get(cfg: EasyRLConfig, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _one_of(key: str, value: object, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"{value!r} is not allowed; choose one of: {', '.join(allowed)}")


def validate(cfg: EasyRLConfig, task: str = "rl") -> None:
    """Raise `ConfigError` for the first problem found (enums, numbers, batch arithmetic, files). `task` `sft`
    checks what `easyrl sft` reads: the shared sections and `sft`, not the rollout, reward or RL batch arithmetic."""
    from easyrl.config.limits import check_limits
    from easyrl.config.validate_refs import check_distill, check_reward_scorers

    check_limits(cfg)  # non-finite numbers first: every comparison below is False for a NaN
    _check_enums(cfg)
    _check_tracker_packages(cfg.trainer.logger)
    _check_sapo_temperatures(cfg)
    _check_lora(cfg)
    _check_numbers(cfg)
    _check_rollout_correction(cfg)
    _check_sequence_parallel(cfg)
    _check_hang_bounds(cfg)
    _check_backend(cfg, task)
    check_diffusion(cfg.worker.rollout.diffusion, cfg.worker.actor.model.model_path)
    check_engine_kwargs(cfg.worker.rollout)
    check_engine_capabilities(cfg)  # what the config asks of the engine is what it declared it can do
    if task == "sft":
        from easyrl.config.validate_sft import check_sft

        check_sft(cfg)
        _check_model_and_data(cfg, cfg.sft.max_length, "sft.max_length")
        _check_load_checkpoint(cfg.trainer.load_checkpoint_path)
        return
    if not cfg.worker.reward.reward_function:  # before the RL arithmetic: an SFT config lacks it first of all
        _check_reward_function(None)
    _check_batch_arithmetic(cfg)
    _check_async(cfg)
    _check_files(cfg)
    check_distill(cfg)
    check_multi_turn(cfg.worker.rollout.multi_turn, cfg.data.max_response_length)
    check_reward_scorers(cfg.worker.reward, _check_reward_function)


def _check_backend(cfg: EasyRLConfig, task: str) -> None:
    blockers = inline_blockers(cfg, task) if cfg.trainer.backend == "inline" else []
    if blockers:
        raise ConfigError(
            "trainer.backend", f"inline runs every role in this process, but {'; '.join(blockers)}: set auto or ray"
        )


def _check_enums(cfg: EasyRLConfig) -> None:
    for key, allowed in _ENUMS.items():
        _one_of(key, _get(cfg, key), allowed)
    # the built-ins and whatever `algorithm.user_modules` registered (the loader imported them before validating)
    _one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, declared_estimators())
    _one_of("worker.actor.loss_type", cfg.worker.actor.loss_type, declared_policy_losses())
    _one_of("worker.rollout.name", cfg.worker.rollout.name, declared_engines())
    _one_of("worker.actor.loss_avg_mode", cfg.worker.actor.loss_avg_mode, list(LOSS_AGG_MODES))
    _one_of("worker.critic.loss_avg_mode", cfg.worker.critic.loss_avg_mode, list(LOSS_AGG_MODES))
    _one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, list(KL_PENALTY_KINDS))
    for name in cfg.trainer.logger:
        _one_of("trainer.logger", name, LOGGERS)


def _check_tracker_packages(names: list[str]) -> None:
    """A tracker whose package is missing is found now, not after Ray and the workers have started (`make demo`
    installs none of them). Each tracker's package has its name; `find_spec` imports nothing."""
    import importlib.util

    for name in names:
        if name not in ("console", "file") and importlib.util.find_spec(name) is None:
            raise ConfigError(
                "trainer.logger",
                f"has {name!r} but the {name} package is not installed: "
                f"pip install 'easyrl[loggers]' or pip install {name}",
            )


def _check_sapo_temperatures(cfg: EasyRLConfig) -> None:
    for key in ("worker.actor.tau_positive", "worker.actor.tau_negative"):
        if float(_get(cfg, key)) <= 0:  # type: ignore[arg-type]
            raise ConfigError(key, f"must be > 0 (a SAPO gate temperature), got {_get(cfg, key)}")


def _check_lora(cfg: EasyRLConfig) -> None:
    """LoRA: a non-negative integer rank and sane adapter settings, on the actor and on a critic (`gae`); the
    model-dependent check (target_modules matching no linear layer) runs before the workers start
    (`easyrl.workers.lora.check_targets`)."""
    roles = ("actor", "critic") if declared_needs(cfg.algorithm.adv_estimator).needs_critic else ("actor",)
    for role in roles:
        _check_adapters(getattr(cfg.worker, role).model.lora, f"worker.{role}.model.lora")
    lora = cfg.worker.actor.model.lora
    if lora.rank == 0:
        return
    key = "worker.actor.model.lora"  # how the policy's adapters reach the engine: the actor's alone
    _one_of(f"{key}.rollout_sync", lora.rollout_sync, ["merged", "adapter"])
    if lora.rollout_sync == "adapter" and cfg.worker.rollout.sleep_level == 2:
        raise ConfigError(
            f"{key}.rollout_sync",
            "adapter sends only the adapters and leaves the base weights in the engine, which "
            "worker.rollout.sleep_level=2 discards at every sleep: use sleep_level 1 or rollout_sync=merged",
        )


def _check_adapters(lora: LoraConfig, key: str) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 0:
        raise ConfigError(f"{key}.rank", f"must be a positive integer (0: LoRA off), got {lora.rank!r}")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha", f"must be > 0, got {lora.alpha!r}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{key}.dropout", f"must be in [0, 1), got {lora.dropout!r}")
    if not lora.target_modules.strip().strip(","):
        raise ConfigError(f"{key}.target_modules", "is empty: use all-linear or a comma list such as q_proj,v_proj")
    if lora.exclude_modules is not None:
        try:
            re.compile(lora.exclude_modules)
        except re.error as exc:
            raise ConfigError(f"{key}.exclude_modules", f"is not a regular expression: {exc}") from None


def _check_numbers(cfg: EasyRLConfig) -> None:
    positive = [
        "data.max_prompt_length",
        "data.max_response_length",
        "data.rollout_batch_size",
        "worker.rollout.n",
        "worker.actor.global_batch_size",
        "worker.actor.micro_batch_size_per_device_for_update",
        "worker.actor.micro_batch_size_per_device_for_experience",
        "worker.actor.ppo_epochs",
        "trainer.total_epochs",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
    ]
    for key in positive:
        if not isinstance(_get(cfg, key), int) or int(_get(cfg, key)) < 1:  # type: ignore[call-overload]
            raise ConfigError(key, f"must be a positive integer, got {_get(cfg, key)!r}")
    budget = cfg.worker.actor.log_prob_max_token_len_per_gpu
    if budget is not None and budget < 1:
        raise ConfigError(
            "worker.actor.log_prob_max_token_len_per_gpu", f"must be a positive integer or null (auto), got {budget}"
        )
    if cfg.trainer.max_steps is not None and cfg.trainer.max_steps < 1:
        raise ConfigError("trainer.max_steps", f"must be >= 1 or null, got {cfg.trainer.max_steps}")
    if not cfg.worker.rollout.temperature > 0:  # `not >`: NaN fails too
        # Training takes log-probs of logits / temperature (the sampling distribution); greedy has none.
        raise ConfigError(
            "worker.rollout.temperature",
            f"must be > 0 for training, got {cfg.worker.rollout.temperature}: set it > 0 (e.g. 1.0); greedy decoding "
            "(0) is for validation only: worker.rollout.val_override_config: {temperature: 0}",
        )
    if not 0 < cfg.worker.rollout.top_p <= 1:
        raise ConfigError("worker.rollout.top_p", f"must be in (0, 1], got {cfg.worker.rollout.top_p}")
    if cfg.worker.rollout.top_k < -1:  # both engines read -1 and 0 as "off"
        raise ConfigError(
            "worker.rollout.top_k", f"must be -1 or 0 (off) or a positive integer, got {cfg.worker.rollout.top_k}"
        )
    if not 0 < cfg.worker.rollout.gpu_memory_utilization <= 1:
        raise ConfigError("worker.rollout.gpu_memory_utilization", "must be in (0, 1]")
    if cfg.worker.actor.optim.lr <= 0:
        raise ConfigError("worker.actor.optim.lr", f"must be > 0, got {cfg.worker.actor.optim.lr}")
    if not 0 <= cfg.worker.actor.clip_ratio_low < 1:
        raise ConfigError("worker.actor.clip_ratio_low", "must be in [0, 1)")
    if cfg.worker.actor.clip_ratio_high < 0:
        raise ConfigError("worker.actor.clip_ratio_high", "must be >= 0")
    if cfg.worker.actor.clip_ratio_dual <= 1:
        raise ConfigError("worker.actor.clip_ratio_dual", "must be > 1 (dual clip caps losses at -A * c)")
    ratio = cfg.worker.rollout.logprob_sample_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise ConfigError("worker.rollout.logprob_sample_ratio", "must be in [0, 1] (or null: automatic)")
    if cfg.worker.reward.timeout_s <= 0:
        raise ConfigError("worker.reward.timeout_s", "must be > 0 seconds")
    # Written into the float32 scores like any reward: beyond float32 it would overflow there (NaN fails too).
    if not abs(cfg.worker.reward.fallback_score) <= 3.4028234663852886e38:
        raise ConfigError("worker.reward.fallback_score", "must be a finite float32 value (|x| <= 3.4e38)")
    if cfg.algorithm.filter_low >= cfg.algorithm.filter_high and cfg.algorithm.online_filtering:
        raise ConfigError("algorithm.filter_low", "must be below algorithm.filter_high")
    if not cfg.data.cache_max_gb > 0:  # `not >`: NaN fails too
        raise ConfigError("data.cache_max_gb", f"must be > 0 GiB, got {cfg.data.cache_max_gb}: the disk space to give")


def _check_hang_bounds(cfg: EasyRLConfig) -> None:
    """`trainer.hang_timeout_s` must leave room for heartbeats (one a second) and stay below a call's own deadline;
    `trainer.stop_grace_s` is a wait, so >= 0."""
    hang, calls = cfg.trainer.hang_timeout_s, cfg.trainer.worker_timeout_s
    if not 3 <= hang <= max(calls, 3):
        raise ConfigError(
            "trainer.hang_timeout_s",
            f"{hang:g} must be between 3 s (workers beat once a second) and trainer.worker_timeout_s ({calls:g} s)",
        )
    if not 0 <= cfg.trainer.stop_grace_s <= 3600:
        raise ConfigError("trainer.stop_grace_s", f"{cfg.trainer.stop_grace_s:g} must be between 0 and 3600 s")


# verl's newest rejection modes that are ours under another name (theirs judge -log r; the band is the same).
_VERL_RS_NAMES = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}


def _check_rollout_correction(cfg: EasyRLConfig) -> None:
    """`algorithm.rollout_correction` with the `tis_cap` preset: known modes, no setting whose mode is off (it would
    do nothing), bands that keep something, every log-prob asked for, and bypass mode alone."""
    key, alg = "algorithm.rollout_correction", cfg.algorithm
    if alg.tis_cap is not None and not alg.tis_cap > 0:
        raise ConfigError("algorithm.tis_cap", f"must be > 0 (the truncation cap), got {alg.tis_cap}")
    if alg.tis_cap is not None and alg.rollout_correction.rollout_is is not None:
        raise ConfigError(
            "algorithm.tis_cap",
            f"is the preset rollout_is: token, rollout_is_threshold: tis_cap; {key}.rollout_is is set too: keep one",
        )
    corr = alg.correction
    if corr.rollout_is is not None:
        _one_of(f"{key}.rollout_is", corr.rollout_is, ["token", "sequence"])
    if corr.rollout_rs in _VERL_RS_NAMES:
        raise ConfigError(
            f"{key}.rollout_rs", f"{corr.rollout_rs!r} is verl's newer name for {_VERL_RS_NAMES[corr.rollout_rs]!r}"
        )
    if corr.rollout_rs is not None:
        _one_of(f"{key}.rollout_rs", corr.rollout_rs, ["token", "sequence", "geometric"])
    settings = (
        ("rollout_is_threshold_lower", corr.rollout_is_threshold_lower, "rollout_is", corr.rollout_is),
        ("rollout_is_batch_normalize", corr.rollout_is_batch_normalize or None, "rollout_is", corr.rollout_is),
        ("rollout_rs_threshold", corr.rollout_rs_threshold, "rollout_rs", corr.rollout_rs),
        ("rollout_rs_threshold_lower", corr.rollout_rs_threshold_lower, "rollout_rs", corr.rollout_rs),
    )
    for name, value, mode_name, mode in settings:
        if value is not None and mode is None:
            raise ConfigError(f"{key}.{name}", f"does nothing while {mode_name} is null: set {mode_name} or drop it")
    _check_correction_bands(corr, key)
    ratio = cfg.worker.rollout.logprob_sample_ratio
    if corr.reads_rollout_log_probs and ratio is not None and ratio < 1:
        raise ConfigError(
            "algorithm.tis_cap" if alg.tis_cap is not None else key,
            "the rollout correction needs every log-prob: set worker.rollout.logprob_sample_ratio to 1 or null",
        )
    if corr.bypass_mode and corr.active:
        raise ConfigError(
            f"{key}.bypass_mode",
            "uses the engine's log-probs as pi_old and computes none of its own, which rollout_is (or algorithm."
            "tis_cap), rollout_rs and rollout_token_veto_threshold compare with the engine's: turn one side off",
        )
    if corr.bypass_mode and alg.adaptive_entropy:
        raise ConfigError(
            f"{key}.bypass_mode",
            "skips the old-log-prob pass whose entropy algorithm.adaptive_entropy steers by: turn one of them off",
        )


def _check_correction_bands(corr: RolloutCorrectionConfig, key: str) -> None:
    """Thresholds > 0, and each band [lower, upper] non-empty."""
    upper = corr.rollout_is_threshold
    if not upper > 0:
        raise ConfigError(f"{key}.rollout_is_threshold", f"must be > 0, got {upper}")
    lower = corr.rollout_is_threshold_lower
    if lower is not None and not 0 <= lower < upper:
        raise ConfigError(
            f"{key}.rollout_is_threshold_lower", f"{lower} must be in [0, rollout_is_threshold = {upper}) (the band)"
        )
    if corr.rollout_rs is not None:
        upper_rs = corr.rollout_rs_threshold
        if upper_rs is None or not upper_rs > 0:
            raise ConfigError(
                f"{key}.rollout_rs_threshold",
                f"must be > 0 with rollout_rs, got {upper_rs}: the upper edge of the band kept (verl's geo-RS: 1.001)",
            )
        low = 1.0 / upper_rs if corr.rollout_rs_threshold_lower is None else corr.rollout_rs_threshold_lower
        if not 0 <= low < upper_rs:
            raise ConfigError(
                f"{key}.rollout_rs_threshold_lower",
                f"the band [{low:g}, {upper_rs:g}] keeps nothing (a null lower edge is 1 / rollout_rs_threshold): "
                "raise rollout_rs_threshold above 1 or set a lower edge below it",
            )
    veto = corr.rollout_token_veto_threshold
    if veto is not None and not veto > 0:
        raise ConfigError(f"{key}.rollout_token_veto_threshold", f"must be > 0 or null, got {veto}")


def _check_sequence_parallel(cfg: EasyRLConfig) -> None:
    """`ulysses_size` splits each packed row over that many workers: it must divide them, and rows must be packed.
    (That it divides the attention heads is checked with the model's config, in `_check_files`.)"""
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    for role in ("actor", "critic"):
        key, size = f"worker.{role}.ulysses_size", getattr(cfg.worker, role).ulysses_size
        if not isinstance(size, int) or size < 1:
            raise ConfigError(key, f"must be a positive integer, got {size!r}")
        if workers % size:
            raise ConfigError(key, f"{size} must divide the number of workers ({workers})")
        if size > 1 and cfg.worker.actor.padding_free is False:  # null (auto) packs whenever ulysses_size > 1
            raise ConfigError(
                key, f"{size} needs worker.actor.padding_free=true (sequence parallelism splits packed rows)"
            )
    actor, ring = cfg.worker.actor, cfg.worker.actor.ring_size
    if not isinstance(ring, int) or ring < 1:
        raise ConfigError("worker.actor.ring_size", f"must be a positive integer, got {ring!r}")
    if ring > 1 and workers % actor.sp_size:
        raise ConfigError(
            "worker.actor.ring_size",
            f"ulysses_size x ring_size = {actor.ulysses_size} x {ring} must divide the number of workers ({workers})",
        )
    if ring > 1 and actor.padding_free is False:
        raise ConfigError(
            "worker.actor.ring_size",
            f"{ring} needs worker.actor.padding_free=true (ring attention splits packed rows)",
        )


def _check_batch_arithmetic(cfg: EasyRLConfig) -> None:
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    n = cfg.worker.rollout.n
    needs = declared_needs(cfg.algorithm.adv_estimator)
    distill = cfg.algorithm.distill
    estimator_used = not (distill.enabled and not distill.with_task_reward)  # pure distillation computes none
    if needs.grouped and n < 2 and estimator_used:
        raise ConfigError(
            "worker.rollout.n",
            f"{cfg.algorithm.adv_estimator} compares the responses of one prompt, so it needs n >= 2 (got {n})",
        )
    rollout = cfg.data.rollout_batch_size
    if (rollout * n) % workers:
        raise ConfigError(
            "data.rollout_batch_size",
            f"rollout_batch_size * rollout.n = {rollout * n} must divide evenly over {workers} workers",
        )
    for role in ("actor", "critic"):
        if role == "critic" and not needs.needs_critic:
            continue
        wcfg = getattr(cfg.worker, role)
        # the data-parallel size the run will use (`trainer.plan.data_parallel_size`, which sits above config)
        gbs, dp = wcfg.global_batch_size, workers // wcfg.sp_size
        sp_note = (
            f" (data-parallel groups: workers / sequence-parallel group {wcfg.sp_size})" if wcfg.sp_size > 1 else ""
        )
        if gbs > rollout or rollout % gbs:
            raise ConfigError(
                f"worker.{role}.global_batch_size",
                f"{gbs} must divide data.rollout_batch_size ({rollout}): each step makes rollout/global optimizer steps",
            )
        if (gbs * n) % dp:
            raise ConfigError(
                f"worker.{role}.global_batch_size",
                f"global_batch_size * rollout.n = {gbs * n} must divide evenly over {dp} workers{sp_note}",
            )
        per_device = gbs * n // dp
        micro = wcfg.micro_batch_size_per_device_for_update
        # token-budget micro-batches (`worker.actor.dynamic_batching`, which the critic follows) never read the count
        if not cfg.worker.actor.dynamic_batching and per_device % micro:
            raise ConfigError(
                f"worker.{role}.micro_batch_size_per_device_for_update",
                f"{micro} must divide the per-worker mini-batch of {per_device} samples "
                f"(global_batch_size * n / {dp} workers{sp_note})",
            )
    rollout_workers = _check_placement(cfg, workers)
    if (
        cfg.worker.rollout.tensor_parallel_size > rollout_workers
        or rollout_workers % cfg.worker.rollout.tensor_parallel_size
    ):
        raise ConfigError(
            "worker.rollout.tensor_parallel_size", f"must divide the number of rollout workers ({rollout_workers})"
        )
    engines = rollout_workers // cfg.worker.rollout.ranks_per_engine
    prompt_counts = {"data.rollout_batch_size": rollout}
    if cfg.algorithm.online_filtering and cfg.data.mini_rollout_batch_size:
        prompt_counts["data.mini_rollout_batch_size"] = cfg.data.mini_rollout_batch_size
    for key, prompts in prompt_counts.items():
        if prompts % engines:
            raise ConfigError(
                key,
                f"{prompts} prompts must divide evenly over the {engines} rollout engines "
                "(each engine samples all rollout.n responses of its prompts)",
            )


MAX_STALENESS = 64
"""The largest `trainer.max_staleness`: published asynchronous RL runs use 1 to 8; each step of the carry-over loop
walks S + 1 layers of groups and logs S + 1 staleness shares, so millions cost memory and time with no use."""

MAX_TOKENS_IN_FLIGHT = 1 << 32
"""The most tokens the carry-over loop may hold for groups in flight: the driver keeps each in-flight sequence's
token ids (int64) and per-token policy versions, so 2^32 tokens is at least 64 GiB of host memory, far above the
largest published settings (512 groups x 16 x 36k tokens x 5 in flight is 1.5 x 2^30); a larger queue cannot be
held."""


def _check_in_flight(cfg: EasyRLConfig, groups: int) -> None:
    """Refuse a carry-over queue whose tokens cannot be held: `groups` x n x (prompt + response) tokens."""
    rollout, data = cfg.worker.rollout, cfg.data
    tokens = groups * rollout.n * (data.max_prompt_length + data.max_response_length)
    if tokens > MAX_TOKENS_IN_FLIGHT:
        raise ConfigError(
            "trainer.max_staleness",
            f"{groups} prompt groups in flight (worker.rollout.active_groups, null: (max_staleness + 1) * "
            f"data.rollout_batch_size) x n {rollout.n} x {data.max_prompt_length + data.max_response_length} "
            f"tokens each is {tokens:,} tokens, more than the {MAX_TOKENS_IN_FLIGHT:,} a driver can hold: lower "
            "trainer.max_staleness or set worker.rollout.active_groups",
        )


def _check_async(cfg: EasyRLConfig) -> None:
    """`trainer.max_staleness` and the keys of the carry-over loop it turns on (`worker.rollout.active_groups`,
    `chunk_tokens`); what that loop cannot do yet is refused by name."""
    staleness, rollout = cfg.trainer.max_staleness, cfg.worker.rollout
    if not isinstance(staleness, int) or staleness < 0:
        raise ConfigError("trainer.max_staleness", f"must be an integer >= 0 (0: synchronous), got {staleness!r}")
    if staleness == 0:
        for key in ("active_groups", "chunk_tokens"):
            if getattr(rollout, key) is not None:
                raise ConfigError(
                    f"worker.rollout.{key}", "is read only by asynchronous rollouts: set trainer.max_staleness >= 1"
                )
        return
    if staleness > MAX_STALENESS:
        raise ConfigError(
            "trainer.max_staleness",
            f"{staleness} is above {MAX_STALENESS}: the loop keeps (and logs) one layer per version of lag, and a "
            f"token more than {MAX_STALENESS} updates old has importance ratios no correction keeps useful; "
            "use a value between 1 and 8 (docs/async.md)",
        )
    per_step = cfg.data.rollout_batch_size
    groups = rollout.active_groups
    _check_in_flight(cfg, groups if groups is not None else (staleness + 1) * per_step)
    if groups is not None and not per_step <= groups <= (staleness + 1) * per_step:
        raise ConfigError(
            "worker.rollout.active_groups",
            f"{groups} must be between data.rollout_batch_size ({per_step}) and (trainer.max_staleness + 1) * "
            f"rollout_batch_size ({(staleness + 1) * per_step}), or null for the largest",
        )
    if rollout.chunk_tokens is not None and not 1 <= rollout.chunk_tokens <= cfg.data.max_response_length:
        raise ConfigError(
            "worker.rollout.chunk_tokens",
            f"must be between 1 and data.max_response_length ({cfg.data.max_response_length}), or null",
        )
    ratio = rollout.logprob_sample_ratio
    if ratio is not None and ratio < 1:
        raise ConfigError(
            "worker.rollout.logprob_sample_ratio",
            f"{ratio}: with trainer.max_staleness >= 1 every token keeps its behaviour log-prob; set null or 1",
        )
    if declared_needs(cfg.algorithm.adv_estimator).needs_greedy_baseline:
        raise ConfigError(
            "algorithm.adv_estimator",
            f"{cfg.algorithm.adv_estimator} scores a greedy response per prompt, which the asynchronous loop does "
            "not make: use another estimator or trainer.max_staleness: 0",
        )


def _check_files(cfg: EasyRLConfig) -> None:
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    _check_model_and_data(cfg, total, "data.max_response_length")
    for key in ("data.image_dir", "data.video_dir", "data.audio_dir"):
        folder = _get(cfg, key)
        if folder and not Path(str(folder)).is_dir():
            raise ConfigError(key, f"folder not found: {_looked_for(str(folder))}")
    _check_load_checkpoint(cfg.trainer.load_checkpoint_path)
    _check_reward_function(cfg.worker.reward.reward_function)


def _check_model_and_data(cfg: EasyRLConfig, length: int, length_key: str) -> None:
    """The model folder (its context holds `length` tokens, set by `length_key`), tokenizer, data files and
    templates exist."""
    model = cfg.worker.actor.model.model_path
    if not model:
        raise ConfigError("worker.actor.model.model_path", "is required: a Hugging Face model folder or hub ID")
    # A diffusers pipeline (checked by check_diffusion) has a model_index.json and no LLM config, tokenizer or family.
    if not diffusion_enabled(cfg.worker.rollout.diffusion.enable, model):
        if not (Path(model) / "config.json").is_file():
            raise ConfigError(
                "worker.actor.model.model_path", f"no Hugging Face model folder (config.json) at {_looked_for(model)}"
            )
        tok = cfg.worker.actor.model.tokenizer_path
        if tok and not Path(tok).is_dir():
            raise ConfigError("worker.actor.model.tokenizer_path", f"folder not found: {_looked_for(tok)}")
        _check_context_length(Path(model) / "config.json", length, length_key)
        _check_attention_heads(cfg)
        _check_family(cfg, Path(model) / "config.json")
        _check_liger(cfg, Path(model) / "config.json")
        _check_head_kernel(cfg)
        _check_compile_layers(cfg)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", "is required: a jsonl/json/parquet/csv file, a folder or a hub ID")
    for key in ("data.train_files", "data.val_files"):
        value = str(_get(cfg, key) or "")
        for part in filter(None, value.split(",")):
            path = part.rsplit("@", 1)[0] if "@" in part and not os.path.exists(part) else part
            if not os.path.exists(path):
                raise ConfigError(key, f"not found: {_looked_for(path)}")
    if cfg.data.format_prompt and not Path(cfg.data.format_prompt).is_file():
        raise ConfigError("data.format_prompt", f"template file not found: {_looked_for(cfg.data.format_prompt)}")
    chat = cfg.data.override_chat_template
    if chat and chat.endswith(".jinja") and not Path(chat).is_file():
        raise ConfigError("data.override_chat_template", f"template file not found: {_looked_for(chat)}")


def _looked_for(path: str) -> str:
    """A path that was not found, and for a relative one where it was looked for: config paths are relative to the
    working directory, as in EasyR1, which a config kept beside its data does not suggest."""
    if os.path.isabs(path):
        return path
    where = os.getcwd()
    return f"{path} (relative paths are read from the working directory, {where}, not from the config file's folder)"


def _check_load_checkpoint(path: str | None) -> None:
    """A resume target that is not there is found now, not after the workers have started."""
    from easyrl.checkpoint.manager import MANIFEST

    if not path:
        return
    if not Path(path).is_dir():
        raise ConfigError(
            "trainer.load_checkpoint_path",
            f"{path} does not exist; give a global_step_<N> folder of an earlier run, or remove the key",
        )
    if not (Path(path) / MANIFEST).is_file():
        raise ConfigError(
            "trainer.load_checkpoint_path",
            f"{path} is not a checkpoint: it has no {MANIFEST} manifest (give a global_step_<N> folder)",
        )


def _check_attention_heads(cfg: EasyRLConfig) -> None:
    """Ulysses attention gives each rank of a group `heads / ulysses_size` query heads, and needs every token mixer to
    be attention: a linear-attention layer (Qwen3.5's Gated DeltaNet) carries a recurrent state along the whole row."""
    for role in ("actor", "critic"):
        size = getattr(cfg.worker, role).ulysses_size
        path = str(getattr(cfg.worker, role).model.model_path or cfg.worker.actor.model.model_path)
        if getattr(cfg.worker, role).sp_size == 1 or not (Path(path) / "config.json").is_file():
            continue
        hf = json.loads((Path(path) / "config.json").read_text())
        if "linear_attention" in (hf.get("text_config", hf).get("layer_types") or []):
            key = f"worker.{role}.ulysses_size" if size > 1 else "worker.actor.ring_size"
            raise ConfigError(
                key,
                f"{size if size > 1 else cfg.worker.actor.ring_size} splits each row over ranks, but the linear-attention (Gated DeltaNet) layers of {path} carry "
                "a recurrent state along the whole row, which a slice cannot start from; set it to 1",
            )
        heads = hf.get("text_config", hf).get("num_attention_heads") or hf.get("num_attention_heads")
        if heads and heads % size:
            raise ConfigError(
                f"worker.{role}.ulysses_size", f"{size} must divide the model's attention heads ({heads}) in {path}"
            )


_REFUSED_KEYS = (("vllm", "worker.rollout.name", lambda cfg: cfg.worker.rollout.name != "hf"),)
"""(capability of `FamilyProfile.refuses`, the key that asks for it, whether this config asks for it)."""


def _check_family(cfg: EasyRLConfig, config_json: Path) -> None:
    """The model's family (`easyrl.models.family`): a whole Omni model is refused (train its thinker), and so is what
    its family was not run through (the Omni thinkers: the HF engine), with one line rather than failing inside a
    worker."""
    hf = json.loads(config_json.read_text())
    path = cfg.worker.actor.model.model_path
    try:
        family = family_of(str(hf.get("model_type")))
    except UnknownFamilyError as exc:
        raise ConfigError("worker.actor.model.model_path", f"{path}: {exc}") from None
    n_window = (hf.get("audio_config") or {}).get("n_window", 50)
    if family.audio_n_window is not None and n_window != family.audio_n_window:
        # the audio token counts (easyrl.models.family, as transformers' processor) assume its chunks
        raise ConfigError(
            "worker.actor.model.model_path",
            f"{path} has audio_config.n_window={n_window}; the {family.title} processor counts audio tokens with "
            f"{family.audio_n_window} ({2 * family.audio_n_window}-frame chunks): use a thinker whose "
            f"audio_config.n_window is {family.audio_n_window}",
        )
    for capability, key, asked in _REFUSED_KEYS:
        why = family.refusal(capability)
        if why is not None and asked(cfg):
            raise ConfigError(key, f"{path} is a {family.title}: {why}")


def _check_liger(cfg: EasyRLConfig, config_json: Path) -> None:
    """`liger_kernels` asks for Triton kernels: refused on CPU, and for a family Liger is not wired for
    (`FamilyProfile.liger`)."""
    for role in ("actor", "critic"):
        if not getattr(cfg.worker, role).model.liger_kernels:
            continue
        key = f"worker.{role}.model.liger_kernels"
        if cfg.trainer.device == "cpu":
            raise ConfigError(key, "Liger's kernels are Triton (CUDA only) and trainer.device is cpu: set it to false")
        family = family_of(str(json.loads(config_json.read_text()).get("model_type")))
        if family.liger is None:
            wired = ", ".join(p.model_type for p in FAMILIES.values() if p.liger is not None)
            raise ConfigError(
                key, f"wired for {wired} models only, {config_json.parent} is {family.model_type}: set it to false"
            )


def _check_head_kernel(cfg: EasyRLConfig) -> None:
    """`fused_head_kernel: triton` is the fused head's Triton path: refused without the fused head, and on CPU."""
    if cfg.worker.actor.fused_head_kernel != "triton":
        return
    key = "worker.actor.fused_head_kernel"
    if not cfg.worker.actor.fused_logprobs:
        raise ConfigError(key, "triton is a kernel of the fused head and fused_logprobs is false: set it to torch")
    if cfg.trainer.device == "cpu":
        raise ConfigError(key, "the Triton head runs on CUDA only and trainer.device is cpu: set it to torch")


def _check_compile_layers(cfg: EasyRLConfig) -> None:
    """`compile_layers` and `liger_kernels` fuse the same elementwise work two ways: one of them (Liger's patched
    classes inside inductor's graphs have not run on a GPU)."""
    for role in ("actor", "critic"):
        model = getattr(cfg.worker, role).model
        key = f"worker.{role}.model.compile_layers"
        if model.compile_layers and model.liger_kernels:
            raise ConfigError(
                key, f"and worker.{role}.model.liger_kernels both fuse RMSNorm/SwiGLU/RoPE: set one of them to false"
            )


def _check_context_length(config_json: Path, total: int, key: str) -> None:
    try:
        hf = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("worker.actor.model.model_path", f"cannot read {config_json}: {exc}") from None
    text = hf.get("text_config", hf)
    limit = text.get("max_position_embeddings") or hf.get("max_position_embeddings")
    if limit and total > limit:
        what = "max_prompt_length + max_response_length = " if key == "data.max_response_length" else ""
        raise ConfigError(key, f"{what}{total} exceeds the model's context ({limit})")


def _check_reward_function(spec: str | None, key: str = "worker.reward.reward_function") -> None:
    if not spec:
        raise ConfigError(
            key,
            "is required: path/to/file.py:function (a supervised fine-tuning config? give it an `sft:` section and "
            "run `easyrl sft`)",
        )
    file, _, fn = spec.rpartition(":")
    if not file.endswith(".py"):
        raise ConfigError(key, f"expected path/to/file.py:function, got {spec!r}")
    if not Path(file).is_file():
        raise ConfigError(key, f"reward file not found: {_looked_for(file)}")
    try:
        tree = ast.parse(Path(file).read_text(encoding="utf-8"), filename=file)
    except SyntaxError as exc:
        raise ConfigError(key, f"{file} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    names = {
        node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    } | {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    if fn not in names:
        funcs = sorted(n for n in names if not n.isupper())
        raise ConfigError(key, f"no function {fn!r} in {file}; it defines: {', '.join(funcs) or 'nothing'}")


def _check_placement(cfg: EasyRLConfig, workers: int) -> int:
    """`worker.rollout.placement` and `n_gpus`; returns how many workers the engines span (the actor's when
    colocated, `n_gpus` when separate)."""
    rollout = cfg.worker.rollout
    _one_of("worker.rollout.placement", rollout.placement, ["colocated", "separate"])
    _one_of("worker.rollout.weight_transfer", rollout.weight_transfer, ["broadcast", "driver"])
    if rollout.placement == "colocated":
        return workers
    if rollout.n_gpus < 1:
        raise ConfigError("worker.rollout.n_gpus", f"must be >= 1 with placement: separate, got {rollout.n_gpus}")
    lora = cfg.worker.actor.model.lora
    if lora.rank > 0 and lora.rollout_sync == "adapter":
        raise ConfigError(
            "worker.actor.model.lora.rollout_sync",
            "adapter: separate rollout workers receive full (merged) weights; use merged with placement: separate",
        )
    return rollout.n_gpus
