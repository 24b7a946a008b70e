"""A checkpoint written by a real 2-worker run merges into a Hugging Face folder whose logits equal the trained
policy's, and that transformers and vLLM (the CPU build, where installed) both load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from easyrl.merge import main as merge_main
from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


@pytest.mark.vllm  # starts a vLLM engine where vLLM is installed: with the others (tests/conftest.py)
def test_merge_after_training_loads_in_transformers_and_vllm(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    _, _, trained = run(tmp_path, tiny_model_dir, digits_data, {}, steps=1, weights=True)
    assert trained is not None
    merged = tmp_path / "merged"
    assert merge_main([str(tmp_path / "run" / "global_step_1"), "--output", str(merged), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param.detach(), trained[name]), name
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer("Copy: 1 2 3", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed: merged folder checked in transformers only")
    from easyrl.batch import Batch
    from easyrl.config import EasyRLConfig
    from easyrl.rollout.engine import SamplingParams
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec

    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = str(merged)
    engine = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    out = engine.generate(
        Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        SamplingParams(temperature=0.0, max_tokens=1, seed=0),
    )
    first = int(out["responses"][0, 0])
    assert first == int(logits.argmax()), "vLLM's greedy token differs from the merged model's"
    expected = torch.log_softmax(logits, -1)[first]
    assert abs(float(out["rollout_log_probs"][0, 0]) - float(expected)) < 1e-3
