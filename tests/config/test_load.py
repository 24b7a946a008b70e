"""Loading: defaults <- YAML <- CLI, EasyR1 compatibility, secrets masking, and the bad-config table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from easyrl.config import ConfigError, load_config, load_config_and_secrets, to_masked_dict
from tests.conftest import REPO, base_config, write_config


@pytest.fixture
def good_config(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> str:
    return write_config(tmp_path / "good.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))


def test_precedence_defaults_yaml_cli(good_config: str) -> None:
    cfg = load_config(good_config, ["worker.rollout.n=4", "trainer.experiment_name=try1"])
    assert cfg.worker.rollout.n == 4  # CLI beats YAML (2)
    assert cfg.data.rollout_batch_size == 4  # YAML beats the default (512)
    assert cfg.worker.actor.clip_ratio_dual == 3.0  # default
    assert cfg.trainer.experiment_name == "try1"
    assert cfg.worker.reward.reward_function.endswith("digit_fraction_reward.py:compute_score")


def test_a_load_leaves_the_defaults_of_the_next_load_alone(good_config: str) -> None:
    """The defaults are built once per process and shared by every load: a value set by one load (a section's
    field, a list's item) is not a default for the next."""
    first = load_config(good_config, ["worker.actor.clip_ratio_dual=5.0", "trainer.logger=[file,tensorboard]"])
    assert first.worker.actor.clip_ratio_dual == 5.0 and first.trainer.logger == ["file", "tensorboard"]
    first.worker.actor.clip_ratio_dual = 7.0  # the loaded object is the caller's to change
    second = load_config(good_config)
    assert second.worker.actor.clip_ratio_dual == 3.0
    assert second.trainer.logger == ["file"]  # the YAML's


def test_reward_function_default_name_is_main(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"]["reward_function"] = str(REPO / "reward_functions" / "digits.py")
    cfg = load_config(write_config(tmp_path / "c.yaml", conf))
    assert cfg.worker.reward.reward_function.endswith("digits.py:main")


def test_secrets_are_masked(monkeypatch: pytest.MonkeyPatch, good_config: str) -> None:
    monkeypatch.setenv("EASYRL_TEST_SECRET", "s3cr3t-value-123")
    cfg, secrets = load_config_and_secrets(
        good_config,
        [
            "+worker.reward.reward_function_kwargs.api_key=sk-abcdef",
            "trainer.experiment_name=${oc.env:EASYRL_TEST_SECRET}",
        ],
    )
    assert cfg.trainer.experiment_name == "s3cr3t-value-123"  # resolved for use
    text = json.dumps(to_masked_dict(cfg, secrets))
    assert "sk-abcdef" not in text and "s3cr3t-value-123" not in text
    masked = to_masked_dict(cfg, secrets)
    assert masked["worker"]["reward"]["reward_function_kwargs"]["api_key"] == "***"
    assert masked["data"]["prompt_key"] == "prompt"  # our own *_key fields are not secrets


def test_easyr1_config_loads_with_documented_renames(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """An EasyR1-schema config (examples/config.yaml layout) loads; renamed keys are mapped and reported."""
    easyr1 = f"""
data:
  train_files: {digits_data["train"]}
  val_files: {digits_data["val"]}
  prompt_key: prompt
  answer_key: answer
  image_key: images
  max_prompt_length: 48
  max_response_length: 8
  rollout_batch_size: 4
  val_batch_size: -1
  shuffle: true
  seed: 1
  max_pixels: 4194304
  min_pixels: 262144
  filter_overlong_prompts: true
algorithm:
  adv_estimator: grpo
  disable_kl: false
  use_kl_loss: true
  kl_penalty: low_var_kl
  kl_coef: 1.0e-2
worker:
  actor:
    global_batch_size: 2
    micro_batch_size_per_device_for_update: 1
    micro_batch_size_per_device_for_experience: 2
    max_grad_norm: 1.0
    padding_free: false
    loss_avg_mode: token
    model:
      model_path: {tiny_model_dir}
      enable_gradient_checkpointing: true
      trust_remote_code: false
      freeze_vision_tower: false
    optim:
      lr: 1.0e-6
      weight_decay: 1.0e-2
      strategy: adamw
      lr_warmup_ratio: 0.0
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: false
      enable_rank0_init: true
    offload:
      offload_params: true
      offload_optimizer: true
  rollout:
    n: 5
    temperature: 1.0
    top_p: 0.99
    gpu_memory_utilization: 0.6
    enforce_eager: false
    enable_chunked_prefill: false
    tensor_parallel_size: 2
    limit_images: 0
    val_override_config:
      temperature: 0.5
      n: 1
  ref:
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: true
      enable_rank0_init: true
    offload:
      offload_params: false
  reward:
    reward_type: batch
    score_function: {REPO / "reward_functions" / "digits.py"}:compute_score
trainer:
  total_episodes: 2
  logger: ["console", "wandb"]
  project_name: easy_r1
  experiment_name: qwen2_5_7b_math_grpo
  n_gpus_per_node: 2
  nnodes: 1
  val_freq: 5
  val_before_train: true
  val_only: false
  val_generations_to_log: 3
  save_freq: 5
  save_limit: 3
  save_checkpoint_path: null
  load_checkpoint_path: null
"""
    path = tmp_path / "easyr1.yaml"
    path.write_text(easyr1)
    told: list[str] = []
    cfg = load_config(path, notes=told)
    assert cfg.worker.reward.reward_function.endswith("digits.py:compute_score")
    assert cfg.trainer.total_epochs == 2
    assert cfg.worker.actor.loss_avg_mode == "token-mean"
    notes = " ".join(told)
    assert "score_function" in notes and "total_episodes" in notes and "enable_rank0_init" in notes


def _mutate(conf: dict, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    node = conf
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


RC = "algorithm.rollout_correction"
# (case id, YAML edits {dotted key: value} or CLI overrides, the key the message must name, a word of the fix)
BAD = [
    ("unknown-section", {"datas": {"x": 1}}, "datas", "Did you mean data"),
    ("unknown-nested", {"worker.rollout.temprature": 0.5}, "worker.rollout.temprature", "temperature"),
    ("unknown-deep", {"worker.actor.optim.learning_rate": 1e-5}, "worker.actor.optim.learning_rate", "Did you mean"),
    ("type-int", ["worker.rollout.n=abc"], "worker.rollout.n", "Integer"),
    ("type-float-to-int", {"data.max_prompt_length": 1.5}, "data.max_prompt_length", "Integer"),
    ("type-bool", {"trainer.val_before_train": "maybe"}, "trainer.val_before_train", "bool"),
    ("section-scalar", {"worker.actor": 3}, "worker.actor", "mapping"),
    ("enum-estimator", {"algorithm.adv_estimator": "grpoo"}, "algorithm.adv_estimator", "grpo"),
    ("enum-engine", {"worker.rollout.name": "sglang"}, "worker.rollout.name", "hf, vllm"),
    ("placement", {"worker.rollout.placement": "remote"}, "worker.rollout.placement", "colocated, separate"),
    (
        "separate-no-workers",
        {"worker.rollout.placement": "separate", "worker.rollout.n_gpus": 0},
        "worker.rollout.n_gpus",
        "must be >= 1 with placement: separate",
    ),
    (
        "separate-adapters",
        {
            "worker.rollout.placement": "separate",
            "worker.rollout.name": "vllm",
            "worker.actor.model.lora.rank": 8,
            "worker.actor.model.lora.rollout_sync": "adapter",
        },
        "worker.actor.model.lora.rollout_sync",
        "use merged with placement: separate",
    ),
    (
        "sleep-level",
        {"worker.rollout.name": "vllm", "worker.rollout.sleep_level": 3},
        "worker.rollout.sleep_level",
        "must be 1, 2 or null",
    ),
    (
        "sleep-level-hf",
        {"worker.rollout.sleep_level": 1},
        "worker.rollout.sleep_level",
        "1, but the hf engine declares no sleep levels: remove it (null), or use worker.rollout.name=vllm",
    ),
    (
        "tp-without-tensor-parallel",
        {"worker.rollout.tensor_parallel_size": 2},
        "worker.rollout.tensor_parallel_size",
        "2, but the hf engine does not declare tensor parallelism (one engine per worker): set it to 1, or use "
        "worker.rollout.name=vllm",
    ),
    ("staleness-negative", {"trainer.max_staleness": -1}, "trainer.max_staleness", "must be an integer >= 0"),
    (
        "hang-timeout-below-a-heartbeat",
        {"trainer.hang_timeout_s": 1},
        "trainer.hang_timeout_s",
        "1 must be between 3 s (workers beat once a second) and trainer.worker_timeout_s (3600 s)",
    ),
    (
        "staleness-in-the-millions",
        {"trainer.max_staleness": 2_000_000},
        "trainer.max_staleness",
        "2000000 is above 64: the loop keeps (and logs) one layer per version of lag",
    ),
    (
        "in-flight-queue-too-large-to-hold",
        {"trainer.max_staleness": 64, "data.rollout_batch_size": 4096, "worker.rollout.n": 1024},
        "trainer.max_staleness",
        "266240 prompt groups in flight (worker.rollout.active_groups, null: (max_staleness + 1) * data.rollout_batch_size) x n 1024 x 56 tokens each is 15,267,266,560 tokens, more than the 4,294,967,296",
    ),
    (
        "active-groups-when-sync",
        {"worker.rollout.active_groups": 8},
        "worker.rollout.active_groups",
        "set trainer.max_staleness >= 1",
    ),
    (
        "active-groups-past-the-bound",
        {"trainer.max_staleness": 1, "worker.rollout.active_groups": 9},
        "worker.rollout.active_groups",
        "between data.rollout_batch_size (4) and (trainer.max_staleness + 1) * rollout_batch_size (8)",
    ),
    (
        "chunk-longer-than-a-response",
        {"trainer.max_staleness": 1, "worker.rollout.chunk_tokens": 9},
        "worker.rollout.chunk_tokens",
        "between 1 and data.max_response_length (8)",
    ),
    (
        "async-needs-every-logprob",
        {"trainer.max_staleness": 1, "worker.rollout.logprob_sample_ratio": 0.5},
        "worker.rollout.logprob_sample_ratio",
        "every token keeps its behaviour log-prob",
    ),
    (
        "async-remax",
        {"trainer.max_staleness": 1, "algorithm.adv_estimator": "remax"},
        "algorithm.adv_estimator",
        "does not make",
    ),
    (
        "tis-needs-every-logprob",
        {"algorithm.tis_cap": 2.0, "worker.rollout.logprob_sample_ratio": 0.5},
        "algorithm.tis_cap",
        "every log-prob",
    ),
    ("enum-kl", {"algorithm.kl_penalty": "k5"}, "algorithm.kl_penalty", "low_var_kl"),
    ("rc-is-level", {f"{RC}.rollout_is": "geometric"}, f"{RC}.rollout_is", "token, sequence"),
    ("rc-rs-verl-name", {f"{RC}.rollout_rs": "seq_mean_k1"}, f"{RC}.rollout_rs", "'geometric'"),
    ("rc-rs-needs-threshold", {f"{RC}.rollout_rs": "geometric"}, f"{RC}.rollout_rs_threshold", "1.001"),
    (
        "rc-rs-empty-band",
        {f"{RC}.rollout_rs": "token", f"{RC}.rollout_rs_threshold": 0.9},
        f"{RC}.rollout_rs_threshold_lower",
        "keeps nothing",
    ),
    ("rc-orphan-lower", {f"{RC}.rollout_is_threshold_lower": 0.5}, f"{RC}.rollout_is_threshold_lower", "does nothing"),
    ("rc-orphan-rs", {f"{RC}.rollout_rs_threshold": 1.01}, f"{RC}.rollout_rs_threshold", "does nothing"),
    (
        "rc-icepop-band",
        {f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold_lower": 3.0},
        f"{RC}.rollout_is_threshold_lower",
        "[0, rollout_is_threshold",
    ),
    ("rc-veto", {f"{RC}.rollout_token_veto_threshold": 0.0}, f"{RC}.rollout_token_veto_threshold", "> 0"),
    ("rc-tis-cap-twice", {"algorithm.tis_cap": 2.0, f"{RC}.rollout_is": "token"}, "algorithm.tis_cap", "keep one"),
    ("rc-tis-cap-positive", {"algorithm.tis_cap": 0.0}, "algorithm.tis_cap", "> 0"),
    (
        "rc-bypass-with-is",
        {f"{RC}.bypass_mode": True, f"{RC}.rollout_is": "token"},
        f"{RC}.bypass_mode",
        "computes none of its own",
    ),
    ("rc-bypass-with-tis-cap", {f"{RC}.bypass_mode": True, "algorithm.tis_cap": 2.0}, f"{RC}.bypass_mode", "tis_cap"),
    (
        "rc-bypass-adaptive-entropy",
        {f"{RC}.bypass_mode": True, "algorithm.adaptive_entropy": True},
        f"{RC}.bypass_mode",
        "adaptive_entropy",
    ),
    (
        "rc-bypass-every-logprob",
        {f"{RC}.bypass_mode": True, "worker.rollout.logprob_sample_ratio": 0.5},
        RC,
        "every log-prob",
    ),
    ("enum-agg", {"worker.actor.loss_avg_mode": "sum"}, "worker.actor.loss_avg_mode", "token-mean"),
    ("enum-loss", {"worker.actor.loss_type": "ppo2"}, "worker.actor.loss_type", "gspo"),
    ("enum-logger", {"trainer.logger": ["console", "neptune"]}, "trainer.logger", "wandb"),
    ("enum-bad-row", {"data.on_bad_row": "skip"}, "data.on_bad_row", "drop, error"),
    ("enum-kl-type", {"algorithm.kl_type": "pid"}, "algorithm.kl_type", "adaptive"),
    ("enum-optim", {"worker.actor.optim.strategy": "sgd"}, "worker.actor.optim.strategy", "adamw"),
    ("group-needs-n", {"worker.rollout.n": 1}, "worker.rollout.n", "n >= 2"),
    (
        "rollout-divisible",
        {
            "algorithm.adv_estimator": "reinforce_plus_plus",
            "worker.rollout.n": 1,
            "data.rollout_batch_size": 3,
            "worker.actor.global_batch_size": 1,
        },
        "data.rollout_batch_size",
        "workers",
    ),
    ("global-divides-rollout", {"worker.actor.global_batch_size": 3}, "worker.actor.global_batch_size", "divide"),
    ("global-too-big", {"worker.actor.global_batch_size": 8}, "worker.actor.global_batch_size", "divide"),
    (
        "micro-divides",
        {"worker.actor.micro_batch_size_per_device_for_update": 3},
        "worker.actor.micro_batch_size_per_device_for_update",
        "divide",
    ),
    ("context-length", {"data.max_response_length": 5000}, "data.max_response_length", "context"),
    (
        "model-missing",
        {"worker.actor.model.model_path": "/nonexistent/model"},
        "worker.actor.model.model_path",
        "config.json",
    ),
    ("model-required", {"worker.actor.model.model_path": None}, "worker.actor.model.model_path", "required"),
    ("train-missing", {"data.train_files": "/nonexistent/train.jsonl"}, "data.train_files", "not found"),
    ("val-missing", {"data.val_files": "/nonexistent/val.parquet"}, "data.val_files", "not found"),
    # a relative path is read from the working directory, which a config kept beside its data does not suggest
    ("train-relative", {"data.train_files": "mytask/train.jsonl"}, "data.train_files", "from the working directory"),
    (
        "reward-relative",
        {"worker.reward.reward_function": "mytask/reward.py:main"},
        "worker.reward.reward_function",
        "from the working directory",
    ),
    ("template-missing", {"data.format_prompt": "/nonexistent/t.jinja"}, "data.format_prompt", "not found"),
    (
        "reward-file-missing",
        {"worker.reward.reward_function": "/nonexistent/r.py:fn"},
        "worker.reward.reward_function",
        "not found",
    ),
    (
        "reward-fn-missing",
        {"worker.reward.reward_function": str(REPO / "reward_functions" / "digits.py") + ":nope"},
        "worker.reward.reward_function",
        "compute_score",
    ),
    ("reward-not-py", {"worker.reward.reward_function": "rewards.txt:fn"}, "worker.reward.reward_function", "file.py"),
    ("temperature", {"worker.rollout.temperature": -1.0}, "worker.rollout.temperature", "> 0"),
    ("greedy-training", {"worker.rollout.temperature": 0.0}, "worker.rollout.temperature", "val_override_config"),
    ("top-p", {"worker.rollout.top_p": 0.0}, "worker.rollout.top_p", "(0, 1]"),
    ("lr", {"worker.actor.optim.lr": 0.0}, "worker.actor.optim.lr", "> 0"),
    ("dual-clip", {"worker.actor.clip_ratio_dual": 0.5}, "worker.actor.clip_ratio_dual", "> 1"),
    ("max-steps", {"trainer.max_steps": 0}, "trainer.max_steps", ">= 1"),
    (
        "tp-size",
        {"worker.rollout.name": "vllm", "worker.rollout.tensor_parallel_size": 3},
        "worker.rollout.tensor_parallel_size",
        "divide",
    ),
    ("image-dir", {"data.image_dir": "/nonexistent/images"}, "data.image_dir", "not found"),
    ("override-form", ["worker.rollout.n"], "worker.rollout.n", "key=value"),
    ("top-k", {"worker.rollout.top_k": -7}, "worker.rollout.top_k", "-1 or 0 (off) or a positive integer"),
    ("fallback-f32", {"worker.reward.fallback_score": 1e39}, "worker.reward.fallback_score", "float32"),
    (
        "resume-missing",
        {"trainer.load_checkpoint_path": "/nonexistent/global_step_3"},
        "trainer.load_checkpoint_path",
        "does not exist",
    ),
    ("resume-not-checkpoint", {"trainer.load_checkpoint_path": str(REPO)}, "trainer.load_checkpoint_path", "COMPLETE"),
    ("override-bad-list", ["trainer.logger=[console,file"], "trainer.logger", "does not parse"),
    ("override-not-utf8", ["data.train_files=/data/\udcff\udcfe.jsonl"], "data.train_files", "not UTF-8"),
    (
        "env-missing",
        ["trainer.experiment_name=${oc.env:EASYRL_SURELY_UNSET_VAR}"],
        "trainer.experiment_name",
        "EASYRL_SURELY_UNSET_VAR",
    ),
]


@pytest.mark.parametrize(("edits", "key", "hint"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_the_culprit(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], edits: object, key: str, hint: str
) -> None:
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    overrides: list[str] = []
    if isinstance(edits, dict):
        for dotted, value in edits.items():
            _mutate(conf, dotted, value)
    else:
        overrides = list(edits)  # type: ignore[call-overload]
    path = write_config(tmp_path / "bad.yaml", conf)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert info.value.key == key, message
    assert message.startswith(key), message
    assert hint in message, message


def test_micro_batch_count_is_checked_only_where_it_is_used(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """configs/demo.yaml with a smaller batch (a newcomer's first edit) stopped on a micro-batch count that token-budget
    micro-batches (`dynamic_batching`, the default) never read."""
    path = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    odd = ["worker.actor.micro_batch_size_per_device_for_update=3"]  # 2 prompts x n=2 / 2 workers = 2 per worker
    assert load_config(path, [*odd, "worker.actor.dynamic_batching=true"]).worker.actor.dynamic_batching
    with pytest.raises(ConfigError, match="3 must divide the per-worker mini-batch of 2 samples"):
        load_config(path, [*odd, "worker.actor.dynamic_batching=false"])


def test_a_tracker_not_installed_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """`make demo` installs no tracker: naming one stops the config load (and `easyrl check`), not the trainer after
    Ray and the workers have started, with a traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    path = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    assert load_config(path, ["trainer.logger=[console,file]"]).trainer.logger == ["console", "file"]
    with pytest.raises(ConfigError) as info:
        load_config(path, ["trainer.logger=[console,wandb]"])
    assert info.value.key == "trainer.logger"
    assert "the wandb package is not installed: pip install 'easyrl[loggers]' or pip install wandb" in str(info.value)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("trainer:\n  experiment_name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(latin1)


def test_cli_one_line_for_non_utf8_and_malformed_overrides(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    """Undecodable bytes from the shell and a malformed list: one line naming the key, no traceback, and the
    value (which may be a secret) not repeated."""
    path = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    for override, key in (
        (os.fsencode("data.train_files=/data/") + b"\xff\xfe.jsonl", "data.train_files"),
        (b"+worker.reward.reward_function_kwargs.api_keys=[sk-secret-123", "worker.reward.reward_function_kwargs"),
    ):
        proc = subprocess.run(
            [sys.executable.encode(), b"-m", b"easyrl.cli", b"check", path.encode(), override],
            capture_output=True,
            timeout=120,
        )
        err = proc.stderr.decode("utf-8", "replace")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and key in lines[0], err
        assert "Traceback" not in err and "sk-secret-123" not in err


def test_cli_exits_2_fast_naming_the_key(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> None:
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["rollout"]["temprature"] = 0.5
    path = write_config(tmp_path / "bad.yaml", conf)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "easyrl.cli", "train", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert len(lines) == 1 and "worker.rollout.temprature" in lines[0] and "temperature" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    # Fast by construction, not by a wall-time bound tuned on one CPU: the error comes before torch, transformers
    # or Ray are even imported (those imports alone take seconds; starting Ray and the workers, tens of seconds).
    assert imported and not imported & {"torch", "transformers", "ray", "vllm"}, sorted(imported)


def test_example_vl_config_validates_with_local_paths(tmp_path: Path) -> None:
    """configs/geo_grpo_qwen2_5_vl.yaml (vLLM rollout of a VL model) passes validation once its paths exist."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    model = build_tiny_vl_checkpoint(tmp_path / "model")
    data = tmp_path / "geo.jsonl"
    data.write_text('{"problem": "<image>x?", "answer": "1", "images": []}\n')
    cfg = load_config(
        REPO / "configs" / "geo_grpo_qwen2_5_vl.yaml",
        [
            f"worker.actor.model.model_path={model}",
            f"data.train_files={data}",
            f"data.val_files={data}",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
        ],
    )
    assert cfg.worker.rollout.name == "vllm" and cfg.data.limit_images == 1
