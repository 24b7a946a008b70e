"""EasyR1 drop-in: its config layout and example-script overrides pass `easyrl check` on EasyR1-format data, the
recipes in configs/easyr1 validate with local stand-ins, and one GRPO step runs on CPU through an EasyR1-layout
text config (reference with FSDP CPU offload, then `easyrl merge --local_dir`) and a vision-language config.

The EasyR1-layout config and the override lists are written here from EasyR1's documented schema and its example
scripts' settings; model and data paths are swapped for tiny local stand-ins, batch sizes for small ones."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from easyrl.config import load_config
from tests.conftest import REPO, easyrl_in_process


RECIPES = sorted((REPO / "configs" / "easyr1").glob("*.yaml")) + sorted((REPO / "configs" / "agentic").glob("*.yaml"))
"""The EasyR1 recipes, and the agentic ones (docs/agentic.md) on the same stand-ins."""

# EasyR1's config layout and spellings (its examples/config.yaml schema), with easyrl's reward and template files.
EASYR1_LAYOUT: dict[str, Any] = {
    "data": {
        "train_files": "hiyouga/math12k@train",
        "val_files": "hiyouga/math12k@test",
        "prompt_key": "problem",
        "answer_key": "answer",
        "image_key": "images",
        "video_key": "videos",
        "image_dir": None,
        "video_fps": 2.0,
        "max_prompt_length": 2048,
        "max_response_length": 2048,
        "rollout_batch_size": 512,
        "mini_rollout_batch_size": None,
        "val_batch_size": 1024,
        "format_prompt": "./prompt_templates/math.jinja",
        "override_chat_template": None,
        "shuffle": True,
        "seed": 1,
        "min_pixels": 262144,
        "max_pixels": 4194304,
        "filter_overlong_prompts": True,
    },
    "algorithm": {
        "adv_estimator": "grpo",
        "disable_kl": False,
        "use_kl_loss": True,
        "kl_penalty": "low_var_kl",
        "kl_coef": 1.0e-2,
        "online_filtering": False,
        "filter_key": "overall",
        "filter_low": 0.01,
        "filter_high": 0.99,
    },
    "worker": {
        "actor": {
            "global_batch_size": 128,
            "micro_batch_size_per_device_for_update": 1,
            "micro_batch_size_per_device_for_experience": 2,
            "max_grad_norm": 1.0,
            "padding_free": True,
            "dynamic_batching": True,
            "ulysses_size": 1,
            "model": {
                "model_path": "Qwen/Qwen2.5-7B-Instruct",
                "enable_gradient_checkpointing": True,
                "trust_remote_code": False,
                "freeze_vision_tower": False,
                "lora": {"rank": 0, "alpha": 64, "target_modules": "all-linear", "exclude_modules": ".*visual.*"},
            },
            "optim": {"lr": 1.0e-6, "weight_decay": 1.0e-2, "strategy": "adamw", "lr_warmup_ratio": 0.0},
            "fsdp": {"enable_full_shard": True, "enable_cpu_offload": False, "enable_rank0_init": True},
            "offload": {"offload_params": True, "offload_optimizer": True},
        },
        "rollout": {
            "n": 5,
            "temperature": 1.0,
            "top_p": 1.0,
            "limit_images": 0,
            "gpu_memory_utilization": 0.6,
            "enforce_eager": False,
            "enable_chunked_prefill": False,
            "tensor_parallel_size": 2,
            "disable_tqdm": False,
            "val_override_config": {"temperature": 0.6, "top_p": 0.95, "n": 1},
        },
        "ref": {
            "fsdp": {"enable_full_shard": True, "enable_cpu_offload": True, "enable_rank0_init": True},
            "offload": {"offload_params": False},
        },
        "reward": {"reward_function": "./reward_functions/math.py:compute_score"},
    },
    "trainer": {
        "total_epochs": 15,
        "max_steps": None,
        "project_name": "easy_r1",
        "experiment_name": "qwen2_5_7b_math_grpo",
        "logger": ["file"],
        "nnodes": 1,
        "n_gpus_per_node": 8,
        "max_try_make_batch": 20,
        "val_freq": 5,
        "val_before_train": True,
        "val_only": False,
        "val_generations_to_log": 3,
        "save_freq": 5,
        "save_limit": 3,
        "save_model_only": False,
        "save_checkpoint_path": None,
        "load_checkpoint_path": None,
        "find_last_checkpoint": True,
    },
}

# The override lists of EasyR1's example scripts (model and data IDs left out: the stand-ins replace them).
GEO = ["data.train_files=GEO@train", "data.val_files=GEO@test"]
SCRIPT_OVERRIDES: dict[str, list[str]] = {
    "qwen2_5_7b_math_grpo": [],
    "qwen3_4b_math_grpo": ["data.max_response_length=4096", "trainer.experiment_name=qwen3_4b_math_grpo"],
    "qwen2_5_vl_7b_geo3k_grpo": [*GEO, "trainer.experiment_name=geo_grpo", "trainer.n_gpus_per_node=8"],
    "qwen2_5_vl_7b_geo3k_dapo": [
        *GEO,
        "data.mini_rollout_batch_size=128",
        "worker.actor.clip_ratio_low=0.2",
        "worker.actor.clip_ratio_high=0.28",
        "algorithm.disable_kl=True",
        "algorithm.online_filtering=True",
    ],
    "qwen2_5_vl_7b_geo3k_gspo": [
        *GEO,
        "worker.actor.loss_type=gspo_token",
        "worker.actor.loss_avg_mode=seq",
        "worker.actor.clip_ratio_low=3e-4",
        "worker.actor.clip_ratio_high=4e-4",
        "algorithm.disable_kl=True",
    ],
    "qwen2_5_vl_7b_geo3k_cispo": [
        *GEO,
        "worker.actor.loss_type=cispo",
        "worker.actor.clip_ratio_low=0",
        "worker.actor.clip_ratio_high=4",
    ],
    "qwen2_5_vl_7b_geo3k_sapo": [*GEO, "worker.actor.loss_type=sapo", "algorithm.disable_kl=True"],
    "qwen2_5_vl_7b_geo3k_reinforce": [
        *GEO,
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.use_kl_loss=false",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_coef=1.0e-3",
    ],
    "qwen2_5_vl_7b_multi_image": [*GEO, "data.rollout_batch_size=256", "worker.rollout.limit_images=2"],
    "qwen2_5_vl_7b_geo3k_swanlab": [*GEO, "trainer.logger=['console','swanlab']"],
    "qwen2_5_vl_3b_geo3k_grpo": [*GEO, "trainer.n_gpus_per_node=2"],
    "qwen2_5_vl_32b_geo3k_grpo": [
        *GEO,
        "worker.actor.fsdp.torch_dtype=bf16",
        "worker.actor.optim.strategy=adamw_bf16",
        "worker.rollout.tensor_parallel_size=8",
    ],
    "qwen3_vl_30b_geo3k_grpo": [
        *GEO,
        "worker.actor.fsdp.torch_dtype=bf16",
        "worker.actor.optim.strategy=adamw_bf16",
        "worker.rollout.tensor_parallel_size=8",
    ],
    "qwen3_vl_4b_geo3k_grpo": [*GEO, "trainer.n_gpus_per_node=2"],
}


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40 + 8 * (i % 3), 32), (20 * i % 255, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def easyr1_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders laid out like the hub repos hiyouga/math12k and hiyouga/geometry3k (data/<split>-*.parquet), with
    their columns: `problem`, `answer`, and for geometry `images` as the {bytes, path} structs `datasets` writes.
    512 training rows: the recipes' data.rollout_batch_size, which `easyrl check` (as `train`) needs usable rows for."""
    root = tmp_path_factory.mktemp("easyr1_data")
    math_rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(32) for b in range(16)]
    geo_rows = [
        {"problem": f"<image>Find x if the angle is {10 * i} degrees.", "answer": str(i), "images": [
            {"bytes": _png(i), "path": None}
        ]}
        for i in range(512)
    ]  # fmt: skip
    for name, rows in (("math12k", math_rows), ("geometry3k", geo_rows)):
        _write_parquet(root / name / "data" / "train-00000-of-00001.parquet", rows)
        _write_parquet(root / name / "data" / "test-00000-of-00001.parquet", rows[:4])
    return {"math": root / "math12k", "geo": root / "geometry3k"}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny text and VL models whose context fits the recipes' 2048 + 4096 tokens, one of each family a recipe
    names (Qwen3.5 is multimodal, so its math recipe runs on a tiny Qwen3.5 with its Qwen3-VL processor)."""
    from easyrl.testing.tiny import build_tiny_checkpoint
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    root = tmp_path_factory.mktemp("stand_ins")
    models = {
        "text": build_tiny_checkpoint(
            root / "text", arch="qwen2", num_heads=2, num_kv_heads=1, max_position_embeddings=8192
        ),
        "qwen2_5_vl": build_tiny_vl_checkpoint(root / "qwen2_5_vl", arch="qwen2_5_vl"),
        "qwen3_vl": build_tiny_vl_checkpoint(root / "qwen3_vl", arch="qwen3_vl"),
        "qwen3_5": build_tiny_vl_checkpoint(root / "qwen3_5", arch="qwen3_5"),
        "qwen3_moe": build_tiny_checkpoint(
            root / "qwen3_moe", arch="qwen3_moe", num_heads=2, num_kv_heads=1, max_position_embeddings=8192
        ),
    }
    for name in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):  # the stand-in only needs to claim the context the recipes use
        file = Path(models[name]) / "config.json"
        config = json.loads(file.read_text())
        for section in (config, config.get("text_config", {})):
            if "max_position_embeddings" in section:
                section["max_position_embeddings"] = 8192
        file.write_text(json.dumps(config))
    return models


def _stand_in_overrides(name: str, models: dict[str, str], data: dict[str, Path]) -> list[str]:
    vl = "vl" in name
    family = next((f for f in ("qwen3_vl", "qwen3_5", "qwen3_30b_a3b") if f in name), "qwen2_5_vl" if vl else "text")
    model = models["qwen3_moe" if family == "qwen3_30b_a3b" else family]
    folder = data["geo" if vl or "geo" in name else "math"]
    return [
        f"worker.actor.model.model_path={model}",
        f"data.train_files={folder}@train",
        f"data.val_files={folder}@test",
        "trainer.device=auto",  # a CPU machine may be the login node of a GPU run: engine problems only warn
    ]


def _check(cfg: Any, gpu_memory_gib: float | None = None) -> str:
    from easyrl.check import run_check

    out = io.StringIO()
    with redirect_stdout(out):
        code = run_check(cfg, gpu_memory_gib)
    assert code == 0, out.getvalue()[-3000:]
    return out.getvalue()


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_passes_check_with_local_stand_ins(
    recipe: Path, stand_ins: dict[str, str], easyr1_data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # recipes name templates and reward files relative to the repository root
    raw = yaml.safe_load(recipe.read_text())
    assert "/" in raw["worker"]["actor"]["model"]["model_path"] and "@" in raw["data"]["train_files"]  # hub IDs
    cfg = load_config(recipe, _stand_in_overrides(recipe.stem, stand_ins, easyr1_data))
    out = _check(cfg, gpu_memory_gib=80)  # `easyrl check --gpu-memory 80`: the stand-in's plan on an H100
    assert "== plan" in out and f"{cfg.worker.actor.loss_type} policy loss" in out
    assert "== memory plan" in out and "GPU: 80 GiB, as --gpu-memory says" in out and "while updating:" in out
    if cfg.worker.rollout.multi_turn.enabled:  # its tools were imported and the first prompt rendered with them
        assert "== first multi-turn prompt, rendered with the tools" in out and "tools: ['python']" in out
        assert "multi-turn: environment none (the dataset's prompts); tools python; up to 8 turns" in out


@pytest.mark.parametrize("script", sorted(SCRIPT_OVERRIDES))
def test_easyr1_layout_with_script_overrides_passes_check(
    script: str,
    tmp_path: Path,
    stand_ins: dict[str, str],
    easyr1_data: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(EASYR1_LAYOUT))
    overrides = [o.replace("GEO", str(easyr1_data["geo"])) for o in SCRIPT_OVERRIDES[script]]
    told: list[str] = []
    cfg = load_config(path, overrides + _stand_in_overrides(script, stand_ins, easyr1_data), told)
    notes = "\n".join(told)
    assert "trainer.max_try_make_batch is EasyR1's name for algorithm.max_try_make_batch" in notes
    assert "worker.rollout.limit_images is EasyR1's name for data.limit_images" in notes
    out = _check(cfg)
    assert "running on CPU: GPU-only settings have no effect" in out or "cuda" in cfg.trainer.device


def test_easyr1_dapo17k_script_checks_its_sequence_parallelism(
    tmp_path: Path,
    stand_ins: dict[str, str],
    easyr1_data: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """EasyR1's Qwen3-14B DAPO script sets worker.actor.ulysses_size=8 on 8 GPUs: `easyrl check` accepts it for a
    model whose attention heads the split divides (Qwen3-14B has 40; tests/config/test_sequence_parallel.py has the
    errors)."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(EASYR1_LAYOUT))
    overrides = [
        "data.format_prompt=./prompt_templates/dapo.jinja",
        "data.max_response_length=20480",
        "data.mini_rollout_batch_size=256",
        "worker.actor.ulysses_size=8",
        "worker.actor.global_batch_size=32",
        "worker.actor.clip_ratio_dual=10.0",
        "worker.rollout.n=16",
        "worker.rollout.tensor_parallel_size=4",
        "worker.reward.reward_function=./reward_functions/dapo.py:compute_score",
        "algorithm.disable_kl=True",
        "algorithm.online_filtering=True",
        "trainer.max_try_make_batch=10",
        *_stand_in_overrides("dapo17k", stand_ins, easyr1_data),
    ]
    eight_heads = build_tiny_checkpoint(
        tmp_path / "m", arch="qwen3", num_heads=8, num_kv_heads=4, max_position_embeddings=32768
    )
    monkeypatch.chdir(REPO)  # the reward file is named relative to the repository root
    proc = easyrl_in_process(capsys, "check", str(path), *overrides, f"worker.actor.model.model_path={eight_heads}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sequence parallel 8 (1 data-parallel groups)" in proc.stdout


def easyrl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "easyrl.cli", *args], capture_output=True, text=True, timeout=900, cwd=cwd
    )


def _small_run(run_dir: Path, model: str, data: Path, extra: list[str]) -> list[str]:
    """EasyR1's layout shrunk to a 1-step CPU run: tiny batches, the HF engine, two workers."""
    return [
        f"worker.actor.model.model_path={model}",
        f"data.train_files={data}@train",
        f"data.val_files={data}@test",
        "data.max_prompt_length=192",
        "data.max_response_length=8",
        "data.rollout_batch_size=4",
        "data.val_batch_size=4",
        "worker.actor.global_batch_size=2",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "worker.actor.micro_batch_size_per_device_for_experience=4",
        "worker.actor.model.enable_gradient_checkpointing=False",
        "worker.rollout.name=hf",
        "worker.rollout.n=2",
        "worker.rollout.tensor_parallel_size=1",
        "worker.rollout.dtype=fp32",
        "worker.reward.num_workers=0",
        "trainer.max_steps=1",
        "trainer.n_gpus_per_node=2",
        "trainer.val_before_train=False",
        "trainer.save_freq=1",
        "trainer.device=cpu",
        "trainer.ray_num_cpus=4",
        f"trainer.save_checkpoint_path={run_dir}",
        *extra,
    ]


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "experiment_log.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "actor/pg_loss" in row or "actor/pg_loss" in row.get("data", {})]


@pytest.mark.slow
def test_one_grpo_step_easyr1_text_layout_then_merge_local_dir(
    tmp_path: Path, stand_ins: dict[str, str], easyr1_data: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """KL on, so the reference is built with EasyR1's `ref.fsdp.enable_cpu_offload: true` (it crashed CPU runs). The
    merge runs `easyrl merge`'s `main` in this process: a command of its own would add a Python start and torch's
    import (~5 s on 2 cores) to the same code."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(EASYR1_LAYOUT))
    run_dir = tmp_path / "run"
    proc = easyrl("train", str(config), *_small_run(run_dir, stand_ins["text"], easyr1_data["math"], []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("running on CPU: GPU-only settings have no effect") == 1
    assert _steps(run_dir), "no training step logged"
    actor = run_dir / "global_step_1" / "actor"
    proc = easyrl_in_process(capsys, "merge", "--local_dir", str(actor))
    assert proc.returncode == 0, proc.stderr[-4000:]
    merged = actor / "huggingface_merged"
    assert proc.stdout.strip().splitlines()[-1].startswith(f"merged model: {merged} ")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(merged)


@pytest.mark.slow
def test_one_grpo_step_easyr1_vl_layout(
    tmp_path: Path, stand_ins: dict[str, str], easyr1_data: dict[str, Path]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(EASYR1_LAYOUT))
    run_dir = tmp_path / "run"
    extra = [
        "data.max_prompt_length=320",
        "data.min_pixels=1024",
        "data.max_pixels=4096",
        "worker.rollout.limit_images=1",
        "algorithm.disable_kl=True",
        "worker.actor.loss_type=sapo",
        "worker.actor.tau_negative=1.5",
        "trainer.save_freq=-1",
        "trainer.save_model_only=True",
    ]
    proc = easyrl("train", str(config), *_small_run(run_dir, stand_ins["qwen2_5_vl"], easyr1_data["geo"], extra))
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = _steps(run_dir)
    assert steps, "no training step logged"
    row = steps[0].get("data", steps[0])
    assert row["actor/pg_clipfrac"] == 0.0  # SAPO clips nothing
    assert row["prompt_length/mean"] > 40  # image tokens expanded into the prompt
