"""`easyrl sft` end to end on 2 CPU workers (real Ray, gloo, FSDP2): training lowers the validation loss and moves
every weight, packed rows and token-budget micro-batches included; a resumed run continues bit for bit; the
checkpoint merges into a Hugging Face folder that transformers loads with the trained weights; LoRA with Ulysses
sequence parallelism trains and merges too."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from easyrl.merge import main as merge_main
from tests.conftest import apply_edits, write_config
from tests.trainer.test_e2e import _VOLATILE


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Digit-copy conversations (messages) for training, prompt/response rows for validation."""
    folder = tmp_path_factory.mktemp("sft_data")
    rng = random.Random(0)

    def task() -> tuple[str, str]:
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 5))]
        return "Copy: " + " ".join(digits), "".join(digits)

    train = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} for p, a in
             (task() for _ in range(48))]  # fmt: skip
    val = [{"prompt": p, "response": a} for p, a in (task() for _ in range(6))]
    paths = {}
    for name, rows in (("train", train), ("val", val)):
        paths[name] = str(folder / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def _config(model: str, data: dict[str, str], run_dir: Path, edits: dict[str, Any]) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "data": {"train_files": data["train"], "val_files": data["val"], "seed": 3},
        "sft": {"max_length": 64},
        "worker": {
            "actor": {
                "global_batch_size": 8,
                "micro_batch_size_per_device_for_experience": 4,
                # packed rows, token-budget micro-batches (several per step at this budget), the fused head
                "padding_free": True,
                "dynamic_batching": True,
                "max_token_len_per_gpu": 96,
                "optim": {"lr": 3e-3, "weight_decay": 0.0},
                "model": {"model_path": model, "enable_gradient_checkpointing": False},
            }
        },
        "trainer": {
            "max_steps": 4,
            "n_gpus_per_node": 2,
            "device": "cpu",
            "logger": ["file"],
            "val_freq": 2,
            "save_freq": 2,
            "save_checkpoint_path": str(run_dir),
        },
    }
    return apply_edits(conf, edits)


def _train(tmp: Path, model: str, data: dict[str, str], edits: dict[str, Any]) -> tuple[list[dict], dict, dict]:
    """Run `easyrl sft` on the test config with `edits`: (logged rows, weights before, weights after)."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.sft_trainer import SFTTrainer

    tmp.mkdir(parents=True, exist_ok=True)
    path = write_config(tmp / "cfg.yaml", _config(model, data, tmp / "run", edits))
    trainer = SFTTrainer(*load_config_and_secrets(path, task="sft"))
    try:
        before = trainer.actor.full_weights()
        trainer.fit()
        after = trainer.actor.full_weights()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp / "run" / "experiment_log.jsonl").read_text().splitlines()]
    return rows, before, after


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, sft_data: dict[str, str]) -> Any:
    tmp = tmp_path_factory.mktemp("straight")
    return tmp, *_train(tmp, tiny_model_dir, sft_data, {})


def test_training_lowers_the_validation_loss_and_moves_every_weight(straight: Any) -> None:
    _, rows, before, after = straight
    val = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in val] == [0, 2, 4]
    assert val[-1]["val/loss"] < val[0]["val/loss"] - 0.5, [r["val/loss"] for r in val]
    assert val[-1]["val/token_accuracy"] > val[0]["val/token_accuracy"]
    assert all(r["val/tokens"] == val[0]["val/tokens"] for r in val)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["train/skipped_updates"] == 0 and r["train/grad_norm"] > 0 for r in steps)
    assert steps[-1]["train/loss"] < steps[0]["train/loss"]
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters the update never moved: {unchanged}"


def test_a_resumed_run_continues_bit_for_bit(tmp_path: Path, straight: Any, tiny_model_dir: str, sft_data) -> None:
    """From the straight run's step-2 checkpoint (its sampler, optimizer and RNG): steps 3 and 4 log the same
    numbers and end at the same weights, to the bit."""
    tmp, rows, _, after = straight
    edits = {"trainer.load_checkpoint_path": str(tmp / "run" / "global_step_2")}
    resumed, _, resumed_after = _train(tmp_path, tiny_model_dir, sft_data, edits)

    def stable(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rs if r["step"] > 2]

    # validation before training, at the checkpoint's step: the weights the straight run validated at step 2
    assert [r["step"] for r in resumed] == [2, 3, 4]
    assert resumed[0]["val/loss"] == next(r["val/loss"] for r in rows if r["step"] == 2)
    assert stable(resumed) == stable(rows)
    assert all(torch.equal(after[name], resumed_after[name]) for name in after)


def test_the_checkpoint_merges_and_loads_in_transformers(tmp_path: Path, straight: Any) -> None:
    tmp, _, _, after = straight
    merged = tmp_path / "merged"
    assert merge_main([str(tmp / "run" / "global_step_4"), "--output", str(merged), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param.detach(), after[name]), name


def test_lora_with_sequence_parallelism_trains_and_merges(tmp_path: Path, tiny_model_dir: str, sft_data) -> None:
    """LoRA adapters on a 2-way Ulysses split: the validation loss falls, only the adapters train, and the merged
    folder holds base + scale * B @ A, which transformers loads."""
    edits = {
        "worker.actor.model.lora": {"rank": 8, "alpha": 16},
        "worker.actor.ulysses_size": 2,
        "worker.actor.global_batch_size": 4,
        "worker.actor.optim.lr": 2e-2,
        "trainer.max_steps": 2,
        "trainer.val_freq": 2,
    }
    rows, before, after = _train(tmp_path, tiny_model_dir, sft_data, edits)
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(val) == 2 and val[1] < val[0], val
    merged = tmp_path / "merged"
    assert merge_main([str(tmp_path / "run" / "global_step_2"), "--output", str(merged), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    weights = dict(model.named_parameters(remove_duplicate=False))
    moved = [name for name in after if not torch.equal(before[name], after[name])]
    assert moved and all(name.endswith("proj.weight") for name in moved), moved  # adapted linear layers only
    for name in moved:
        torch.testing.assert_close(weights[name].detach(), after[name], atol=1e-6, rtol=0)
