"""LoRA end to end on CPU (Ray, 2 FSDP2 workers, the HF engine): adapters-only training with the reference taken
from the same model, the engine in step with the merged policy, small checkpoints with exact resume, and both
merge outputs. The run is PPO (`gae`) with LoRA on its critic too: adapters plus its whole value head."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from easyrl.batch import Batch
from easyrl.config import load_config_and_secrets
from tests.conftest import base_config, write_config
from tests.trainer.test_e2e import _VOLATILE


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
LORA = {"rank": 4, "alpha": 8}


def _config(tmp: Path, model_dir: str, data: dict[str, str], **trainer: Any) -> str:
    conf = base_config(model_dir, data, tmp / "run")
    conf["algorithm"] = {"adv_estimator": "gae", "disable_kl": False, "use_kl_loss": True, "kl_coef": 0.1}
    actor = conf["worker"]["actor"]
    actor["model"]["lora"] = LORA
    conf["worker"]["critic"] = {"global_batch_size": 2, "micro_batch_size_per_device_for_update": 2,
                                "model": {"lora": LORA}, "optim": {"lr": 3e-2}}  # fmt: skip
    actor["model"]["enable_gradient_checkpointing"] = True
    for fast_path in ("dynamic_batching", "fused_logprobs"):  # the defaults: on
        actor.pop(fast_path)
    actor["padding_free"] = True  # packed rows, as on GPUs (null, the default, pads on CPU)
    actor["optim"]["lr"] = 3e-2
    conf["worker"]["rollout"]["logprob_sample_ratio"] = 1.0
    conf["trainer"].update({"save_freq": 1, **trainer})
    tmp.mkdir(parents=True, exist_ok=True)
    return write_config(tmp / "cfg.yaml", conf)


def _rows(tmp: Path) -> list[dict[str, Any]]:
    lines = (tmp / "run" / "experiment_log.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(_VOLATILE)} for line in lines]


def _probe(model_dir: str) -> Batch:
    """Four prompt + response rows for direct log-prob calls."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(3, 90, (4, 6), generator=gen), torch.randint(3, 90, (4, 5), generator=gen)
    ids = torch.cat([prompts, responses], 1)
    mask = torch.ones_like(ids)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": mask.cumsum(1) - 1,
            "responses": responses,
            "response_mask": torch.ones_like(responses),
        }
    )


def _base_log_probs(model_dir: str, batch: Batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, -6:-1]
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, digits_data) -> dict[str, Any]:
    """Two LoRA steps, a checkpoint after each; the reference and policy log-probs of a probe batch at the end."""
    from easyrl.trainer.trainer import Trainer

    tmp = tmp_path_factory.mktemp("lora")
    trainer = Trainer(*load_config_and_secrets(_config(tmp, tiny_model_dir, digits_data, max_steps=2)))
    try:
        assert trainer.workers.ref is None, "LoRA started a reference worker (a second copy of the base)"
        trainer.fit()
        probe = _probe(tiny_model_dir)
        ref = trainer.ref.compute_ref_log_probs(probe)["ref_log_probs"]
        policy = trainer.actor.compute_log_probs(probe)["old_log_probs"]
        merged = trainer.actor.full_weights()
    finally:
        trainer.close()
    return {"tmp": tmp, "rows": _rows(tmp), "probe": probe, "ref": ref, "policy": policy, "merged": merged}


def test_reference_is_the_base_and_engine_follows_the_policy(trained: dict[str, Any], tiny_model_dir: str) -> None:
    rows = trained["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    expected = _base_log_probs(tiny_model_dir, trained["probe"])
    torch.testing.assert_close(trained["ref"], expected, rtol=0, atol=1e-5)
    assert (trained["policy"] - trained["ref"]).abs().max() > 1e-3, "the adapters did not move the policy"
    # the default estimator (k1, `log pi - log ref` of the sampled tokens) has either sign on a few tokens
    assert rows[1]["actor/kl_loss"] != 0, "the KL to the reference is zero after an update"
    # step 2 sampled with the policy after one update: the engine got the merged weights
    assert rows[1]["rollout/logprob_diff_max"] < 1e-3, rows[1]["rollout/logprob_diff_max"]


def test_checkpoint_holds_adapters_and_resume_is_exact(
    trained: dict[str, Any], tmp_path: Path, tiny_model_dir: str, digits_data
) -> None:
    from easyrl.trainer.trainer import Trainer

    step1 = trained["tmp"] / "run" / "global_step_1" / "actor"
    with safe_open(str(step1 / "model_rank0_of2.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:4]
    with safe_open(str(step1 / "optim_rank0_of2.safetensors"), framework="pt") as handle:
        optim_names = list(handle.keys())
        assert optim_names and all(".lora_" in n for n in optim_names)
    with safe_open(str(step1.parent / "critic" / "model_rank0_of2.safetensors"), framework="pt") as handle:
        names = list(handle.keys())  # the critic's adapters and its value head, no frozen base
    assert "score.weight" in names and all(".lora_" in n or n.startswith("score.") for n in names), names[:4]
    resume = {"load_checkpoint_path": str(step1.parent), "max_steps": 2}
    trainer = Trainer(*load_config_and_secrets(_config(tmp_path, tiny_model_dir, digits_data, **resume)))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert _rows(tmp_path) == trained["rows"][1:], "the resumed step left the uninterrupted run"
    for role, rank in itertools.product(("actor", "critic"), range(2)):
        file = f"model_rank{rank}_of2.safetensors"
        a = safe_open(str(trained["tmp"] / "run" / "global_step_2" / role / file), framework="pt")
        b = safe_open(str(tmp_path / "run" / "global_step_2" / role / file), framework="pt")
        names = list(a.keys())
        for name in names:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), f"{role}: {name}"


def test_merge_writes_the_merged_model_and_a_peft_adapter(
    trained: dict[str, Any], tmp_path: Path, tiny_model_dir: str
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from easyrl.checkpoint.errors import CheckpointError
    from easyrl.merge import main as merge_main
    from easyrl.merge import merge_checkpoint

    step2 = str(trained["tmp"] / "run" / "global_step_2")
    merged_dir = str(tmp_path / "merged")
    assert merge_main([step2, "--output", merged_dir, "--base-model", tiny_model_dir]) == 0
    adapter_dir = merge_checkpoint(step2, str(tmp_path / "adapter"), adapter_only=True)
    with pytest.raises(CheckpointError, match=r"base model folder .*gone .*does not exist: pass .*--base-model"):
        merge_checkpoint(step2, str(tmp_path / "m2"), base_model=str(tmp_path / "gone"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    streamed = trained["merged"]  # what the engine got: base + B @ A * scale, gathered on the workers
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, streamed[name], rtol=0, atol=1e-6, msg=name)
    base = AutoModelForCausalLM.from_pretrained(
        json.loads(Path(adapter_dir, "adapter_config.json").read_text())["base_model_name_or_path"],
        dtype=torch.float32,
    )
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    ids = trained["probe"]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5)
        with peft_model.disable_adapter():
            assert not torch.allclose(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits)


def test_vl_lora_trains_the_language_model_only(tmp_path: Path) -> None:
    """Qwen2.5-VL with LoRA and KL on: the vision tower gets no adapters and stays as loaded, the language model's
    adapted weights move, and the engine keeps up with the merged policy."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
    from tests.trainer.test_e2e import run
    from tests.trainer.test_vl_e2e import _image_data, vl_edits

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl")
    data = _image_data(tmp_path / "data")
    edits = vl_edits(data) | {
        "worker.actor.model.lora": LORA,
        "worker.actor.optim.lr": 3e-2,
        "algorithm.disable_kl": False,
        "algorithm.use_kl_loss": True,
        "worker.rollout.logprob_sample_ratio": 1.0,
    }
    rows, before, after = run(tmp_path / "run", model, {"train": data["train"]}, edits, steps=2, weights=True)
    assert before is not None and after is not None
    vision = [n for n in before if ".visual." in f".{n}" or n.startswith(("visual.", "model.visual."))]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision), "the vision tower changed"
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved), moved[:5]
    assert rows[1]["rollout/logprob_diff_max"] < 1e-3, rows[1]["rollout/logprob_diff_max"]
