"""Exact resume of a diffusion run: stopped after step 2 and resumed from its checkpoint, the run continues on the
uninterrupted run's curve to the bit (the denoiser's weights, its optimizer, the SDE noise and the trained steps, the
dataloader's position across an epoch boundary, validation and the metrics history), under full fine-tuning and LoRA
with KL to the reference. Validation samples with `val_num_steps`, training with `num_steps`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from tests.conftest import REPO, apply_edits, write_config


pytestmark = pytest.mark.slow  # three short runs per case: ~40 s of CPU time each
# Metrics that depend on wall time or the machine, not on the computation.
_VOLATILE = ("timing_s/", "timing_per_sample_s/", "timing_per_token_ms/", "perf/")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0))


def _config(pipe: str, data: Path, run: Path) -> dict[str, Any]:
    """Two steps per epoch (4 prompts, 2 per step), so steps 3-4 of a resumed run start a new shuffled epoch;
    half of each trajectory's steps train (the subsampling draws from the rollout seed)."""
    colours = ["red", "green", "blue", "white"]
    rows = [{"prompt": f"a {c} image", "answer": c} for c in colours]
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return {
        "data": {
            "train_files": str(data / "train.jsonl"),
            "val_files": str(data / "val.jsonl"),
            "prompt_key": "prompt",
            "answer_key": "answer",
            "rollout_batch_size": 2,
            "shuffle": True,
            "seed": 3,
        },
        "algorithm": {"adv_estimator": "grpo", "disable_kl": True},
        "worker": {
            "actor": {
                "global_batch_size": 2,
                "micro_batch_size_per_device_for_update": 4,
                "micro_batch_size_per_device_for_experience": 4,
                "model": {"model_path": pipe, "enable_gradient_checkpointing": False},
                "optim": {"lr": 1.0e-2, "weight_decay": 0.0},
            },
            "rollout": {
                "name": "diffusers",
                "n": 2,
                "dtype": "fp32",
                "diffusion": {
                    "num_steps": 4,
                    "val_num_steps": 2,
                    "guidance_scale": 1.0,
                    "train_timestep_fraction": 0.5,
                    "height": 32,
                    "width": 32,
                    "max_sequence_length": 8,
                },
                "val_override_config": {"n": 2},
            },
            "reward": {"reward_function": f"{REPO}/reward_functions/colour.py:brightness", "num_workers": 0},
        },
        "trainer": {
            "total_epochs": 10,
            "logger": ["file"],
            "n_gpus_per_node": 1,
            "device": "cpu",
            "val_freq": 2,
            "val_before_train": True,
            "save_freq": 2,
            "save_checkpoint_path": str(run),
        },
    }


def _train(
    folder: Path, pipe: str, edits: dict[str, Any], steps: int, denoised: list[int] | None = None
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The run's logged rows (less the volatile figures) and final weights; `denoised` collects the denoising steps
    of each batch the reward scores (training and validation alike), in order."""
    from easyrl.batch import Batch
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    conf = apply_edits(_config(pipe, folder / "data", folder / "run"), {**edits, "trainer.max_steps": steps})
    trainer = Trainer(*load_config_and_secrets(write_config(folder / "cfg.yaml", conf)))
    reward_inputs = trainer.reward_inputs

    def recorded(batch: Batch) -> Any:
        if denoised is not None:
            denoised.append(batch["latents"].shape[1] - 1)  # (N, T+1, ...): x_T .. x_0
        return reward_inputs(batch)

    trainer.reward_inputs = recorded
    try:
        trainer.fit()
        weights = trainer.actor.full_weights()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (folder / "run" / "experiment_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows], weights


@pytest.mark.parametrize(
    "edits",
    [
        {},
        {
            "worker.actor.model.lora.rank": 4,
            "worker.actor.model.lora.alpha": 8,
            "algorithm.disable_kl": False,
            "algorithm.use_kl_loss": True,
            "algorithm.kl_coef": 0.1,
        },
    ],
    ids=["full", "lora_kl"],
)
def test_resume_equals_the_uninterrupted_run(tmp_path: Path, pipeline: str, edits: dict[str, Any]) -> None:
    denoised: list[int] = []
    full, full_weights = _train(tmp_path / "full", pipeline, edits, steps=4, denoised=denoised)
    # validation before step 1 and after steps 2 and 4 samples with val_num_steps (2), training with num_steps (4)
    assert denoised == [2, 4, 4, 2, 4, 4, 2]
    first, _ = _train(tmp_path / "split", pipeline, edits, steps=2)
    assert (tmp_path / "split" / "run" / "global_step_2").is_dir()
    # the same folder, a longer run: the last checkpoint (step 2) is found and the run continues at step 3
    resumed, resumed_weights = _train(tmp_path / "split", pipeline, edits, steps=4)
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]  # validation before training and with steps 2 and 4
    assert "val/reward/mean@2" in full[2] and "val/reward/mean@2" in full[4]
    assert first == full[:3]
    # the log holds the whole history once: no second validation of step 2 when the run resumes there
    assert resumed == full, "the resumed run left the uninterrupted curve"
    assert full_weights.keys() == resumed_weights.keys()
    unequal = [k for k in full_weights if not torch.equal(full_weights[k], resumed_weights[k])]
    assert not unequal, f"weights differ after resuming: {unequal[:5]}"
