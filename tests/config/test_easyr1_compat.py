"""Every key of EasyR1's config schema loads, with its meaning: renamed, mapped, accepted or not-yet-available."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, load_config
from tests.conftest import base_config, write_config


# EasyR1's config schema (verl/trainer/config.py and verl/workers/*/config.py, fields set from a config), one
# value per key. Values are EasyR1's defaults where they fit the tiny test config, else a value that does.
EASYR1_KEYS: dict[str, Any] = {
    **{
        f"data.{k}": v
        for k, v in {
            "prompt_key": "prompt",
            "answer_key": "answer",
            "image_key": "images",
            "video_key": "videos",
            "image_dir": None,
            "video_fps": 2.0,
            "max_prompt_length": 48,
            "max_response_length": 8,
            "rollout_batch_size": 4,
            "mini_rollout_batch_size": None,
            "val_batch_size": -1,
            "override_chat_template": None,
            "shuffle": True,
            "seed": 1,
            "min_pixels": 262144,
            "max_pixels": 4194304,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 16,
        }.items()
    },
    **{
        f"algorithm.{k}": v
        for k, v in {
            "gamma": 1.0,
            "lam": 1.0,
            "adv_estimator": "grpo",
            "disable_kl": False,
            "use_kl_loss": True,
            "kl_penalty": "low_var_kl",
            "kl_coef": 1e-2,
            "kl_type": "fixed",
            "kl_horizon": 10000.0,
            "kl_target": 0.1,
            "online_filtering": False,
            "filter_key": "overall",
            "filter_low": 0.01,
            "filter_high": 0.99,
        }.items()
    },
    **{
        f"trainer.{k}": v
        for k, v in {
            "total_epochs": 1,
            "max_steps": 2,
            "project_name": "easy_r1",
            "experiment_name": "demo",
            "logger": ["file"],
            "nnodes": 1,
            "n_gpus_per_node": 2,
            "max_try_make_batch": 20,
            "critic_warmup": 0,
            "val_freq": -1,
            "val_before_train": True,
            "val_only": False,
            "val_generations_to_log": 0,
            "save_freq": -1,
            "save_limit": -1,
            "save_model_only": False,
            "load_checkpoint_path": None,
            "ray_timeline": None,
            "find_last_checkpoint": True,
        }.items()
    },
    "worker.hybrid_engine": True,
    **{
        f"worker.actor.{k}": v
        for k, v in {
            "strategy": "fsdp",
            "global_batch_size": 2,
            "micro_batch_size_per_device_for_update": 2,
            "micro_batch_size_per_device_for_experience": 4,
            "max_grad_norm": 1.0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
            "clip_ratio_dual": 3.0,
            "loss_avg_mode": "token",
            "loss_type": "default",
            "ppo_epochs": 1,
            "padding_free": True,
            "dynamic_batching": True,
            "ulysses_size": 1,
            "use_torch_compile": True,
            "tau_positive": 1.0,
            "tau_negative": 1.05,
        }.items()
    },
    **{
        f"worker.{role}.model.{k}": v
        for role in ("actor", "critic")
        for k, v in {
            "tokenizer_path": None,
            "override_config": {},
            "enable_gradient_checkpointing": True,
            "trust_remote_code": False,
            "freeze_vision_tower": False,
            "lora.rank": 0,
            "lora.alpha": 64,
            "lora.target_modules": "all-linear",
            "lora.exclude_modules": ".*visual.*",
        }.items()
    },
    **{
        f"worker.{role}.optim.{k}": v
        for role in ("actor", "critic")
        for k, v in {
            "lr": 1e-6,
            "betas": [0.9, 0.999],
            "weight_decay": 1e-2,
            "strategy": "adamw",
            "lr_warmup_ratio": 0.0,
            "lr_warmup_steps": None,
            "min_lr_ratio": None,
            "lr_scheduler_type": "constant",
        }.items()
    },
    **{
        f"worker.{role}.fsdp.{k}": v
        for role in ("actor", "ref", "critic")
        for k, v in {
            "enable_full_shard": True,
            "enable_cpu_offload": False,
            "enable_rank0_init": True,
            "use_orig_params": False,
            "torch_dtype": None,
            "fsdp_size": -1,
            "mp_param_dtype": "bf16",
            "mp_reduce_dtype": "fp32",
            "mp_buffer_dtype": "fp32",
        }.items()
    },
    **{
        f"worker.{role}.offload.{k}": False
        for role in ("actor", "ref", "critic")
        for k in ("offload_params", "offload_optimizer")
    },
    "worker.ref.strategy": "fsdp",
    **{
        f"worker.critic.{k}": v
        for k, v in {
            "strategy": "fsdp",
            "global_batch_size": 2,
            "micro_batch_size_per_device_for_update": 2,
            "micro_batch_size_per_device_for_experience": 4,
            "max_grad_norm": 1.0,
            "cliprange_value": 0.5,
            "loss_avg_mode": "token",
            "ppo_epochs": 1,
            "padding_free": False,
            "dynamic_batching": True,
            "ulysses_size": 1,
        }.items()
    },
    "worker.reward.reward_function_kwargs": {},
    "worker.reward.skip_special_tokens": True,
    "worker.reward.num_cpus": 1,
    **{
        f"worker.rollout.{k}": v
        for k, v in {
            "name": "hf",
            "n": 2,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 1,
            "limit_images": 0,
            "dtype": "bf16",
            "gpu_memory_utilization": 0.6,
            "ignore_eos": False,
            "enforce_eager": False,
            "enable_chunked_prefill": False,
            "tensor_parallel_size": 1,  # above 1 only for an engine that declares it (vllm), not this hf one
            "max_model_len": None,
            "max_num_batched_tokens": 8192,
            "disable_log_stats": True,
            "disable_tqdm": False,
            "val_override_config": {"temperature": 0.6, "n": 1},
        }.items()
    },
}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    from tests.conftest import apply_edits

    return apply_edits({}, flat)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def conf(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> dict[str, Any]:
    return base_config(tiny_model_dir, digits_data, tmp_path / "run")


def test_every_easyr1_key_loads_in_one_config(tmp_path: Path, conf: dict[str, Any]) -> None:
    told: list[str] = []
    cfg = load_config(write_config(tmp_path / "e.yaml", _merge(conf, _nest(EASYR1_KEYS))), notes=told)
    notes = "\n".join(told)
    assert "trainer.max_try_make_batch is EasyR1's name for algorithm.max_try_make_batch" in notes
    assert "worker.rollout.limit_images is EasyR1's name for data.limit_images" in notes
    assert cfg.worker.actor.loss_type == "ppo"  # EasyR1's "default"
    assert cfg.worker.actor.loss_avg_mode == "token-mean"
    assert cfg.worker.critic.loss_avg_mode == "token-mean"
    assert cfg.worker.actor.optim.min_lr_ratio == 0.0  # EasyR1's null means 0
    assert cfg.worker.actor.tau_negative == 1.05
    assert cfg.worker.actor.model.lora.exclude_modules == ".*visual.*"


@pytest.mark.parametrize("key", sorted(EASYR1_KEYS))
def test_each_easyr1_key_is_accepted_as_an_override(tmp_path: Path, conf: dict[str, Any], key: str) -> None:
    value = EASYR1_KEYS[key]
    load_config(write_config(tmp_path / "c.yaml", _merge(conf, _nest({key: value}))))


def test_trainer_max_try_make_batch_and_rollout_limit_images_keep_their_meaning(
    tmp_path: Path, conf: dict[str, Any]
) -> None:
    path = write_config(tmp_path / "c.yaml", conf)
    cfg = load_config(path, ["trainer.max_try_make_batch=7", "worker.rollout.limit_images=3"])
    assert cfg.algorithm.max_try_make_batch == 7
    assert cfg.data.limit_images == 3
    with pytest.raises(ConfigError, match=r"trainer.max_try_make_batch: is EasyR1's name for algorithm"):
        load_config(path, ["trainer.max_try_make_batch=7", "algorithm.max_try_make_batch=9"])


@pytest.mark.parametrize(
    ("override", "key", "feature"),
    [
        ("worker.actor.tau_negative=0", "worker.actor.tau_negative", "must be > 0"),
    ],
)
def test_values_easyrl_refuses_stop_with_one_line(
    tmp_path: Path, conf: dict[str, Any], override: str, key: str, feature: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: .*{feature}") as info:
        load_config(write_config(tmp_path / "c.yaml", conf), [override])
    assert "\n" not in str(info.value)


def test_easyr1_critic_lora_trains_the_critic_with_adapters(tmp_path: Path, conf: dict[str, Any]) -> None:
    """EasyR1's `worker.critic.model.lora.rank` gives a `gae` run's critic adapters (docs/lora.md)."""
    override = ["algorithm.adv_estimator=gae", "worker.critic.model.lora.rank=16", "worker.critic.global_batch_size=2",
                "worker.critic.micro_batch_size_per_device_for_update=2"]  # fmt: skip
    path = write_config(tmp_path / "c.yaml", conf)
    cfg = load_config(path, override)
    assert cfg.worker.critic.model.lora.rank == 16 and cfg.worker.actor.model.lora.rank == 0
    with pytest.raises(ConfigError, match=r"^worker.critic.model.lora.alpha: must be > 0, got 0$"):
        load_config(path, [*override, "worker.critic.model.lora.alpha=0"])


def test_sapo_and_gspo_token_are_known_losses(tmp_path: Path, conf: dict[str, Any]) -> None:
    path = write_config(tmp_path / "c.yaml", conf)
    for loss in ("sapo", "gspo_token"):
        assert load_config(path, [f"worker.actor.loss_type={loss}"]).worker.actor.loss_type == loss


def test_long_rl_keys_translate_with_a_note(tmp_path: Path, conf: dict[str, Any]) -> None:
    """Long-RL's hour-long-video script (examples/new_supports/qwen2_5_vl_3b_video_1h.sh) sets these three."""
    told: list[str] = []
    overrides = [
        "worker.rollout.num_video_frames=3600",
        "worker.rollout.tokens_per_frame=60",
        "worker.rollout.num_chunk_seq=60",
    ]
    cfg = load_config(write_config(tmp_path / "c.yaml", conf), overrides, told)
    assert cfg.data.max_frames == 3600
    notes = "\n".join(told)
    assert "worker.rollout.num_video_frames is Long-RL's frame count per video" in notes
    assert "using it as data.max_frames" in notes
    assert "worker.rollout.num_chunk_seq is a Long-RL key with no effect in easyrl" in notes
    assert "worker.rollout.tokens_per_frame is a Long-RL key with no effect in easyrl" in notes
    with pytest.raises(ConfigError, match=r"Long-RL's name for data\.max_frames, which is also set"):
        load_config(write_config(tmp_path / "d.yaml", conf), [*overrides[:1], "data.max_frames=64"])
