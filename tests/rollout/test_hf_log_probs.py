"""The HF engine's log-probs are taken step by step as `generate` runs (`easyrl.rollout.hf.SampledLogProbs`), not
from `output_logits` (every step's (B, V) fp32 logits held to the end: an OOM at recipe scale on a GPU). They are
the log-probs of the model's raw logits at the sampling temperature, what the actor computes, even where
transformers' own processors change the scores before easyrl's sampler sees them (`ignore_eos` holds EOS back
through `min_new_tokens`)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from easyrl.rollout.engine import SamplingParams
from easyrl.rollout.hf import HFRolloutEngine
from tests.workers.test_rollout_engines import PROMPTS, left_padded, reference_log_probs


def test_log_probs_are_the_raw_logits_at_the_temperature_step_by_step(tiny_model_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    engine = HFRolloutEngine(tiny_model_dir, torch.device("cpu"), torch.float32, eos, pad)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = left_padded(tokenizer, PROMPTS)
    for params in (
        # every token sampled with EOS held back by transformers' min_new_tokens processor, top-k and top-p on
        SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True),
        SamplingParams(n=1, temperature=0.0, max_tokens=12),  # greedy: scored at temperature 1
    ):
        out = engine.generate(prompts, params)
        mask = out["response_mask"]
        assert mask.any() and (out["rollout_log_probs"] * (1 - mask) == 0).all()
        want = reference_log_probs(model, out, params.temperature or 1.0) * mask
        # the KV-cached decode against one full forward: fp32 summation order only
        torch.testing.assert_close(out["rollout_log_probs"], want, atol=2e-5, rtol=0)
    assert not engine.model._forward_hooks, "the log-prob hook stays on the model after generate"
