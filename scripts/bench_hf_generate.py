"""Compare the HF engine's padded `generate` with transformers' continuous batching (`generate_batch`).

Same model, same prompts, same number of new tokens (sampling, EOS ignored so both do the same work). Prints
tokens/s of each. Used to choose the HF engine's generation path (docs/benchmarks.md).

    python scripts/bench_hf_generate.py --model assets/demo/model --prompts 128 --new-tokens 32
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="assets/demo/model")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    texts = [f"Copy: {' '.join(str((i * 7 + j) % 10) for j in range(3 + i % 4))}" for i in range(args.prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    cfg = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    total = args.prompts * args.new_tokens
    with torch.no_grad():
        model.generate(input_ids=ids[:4], attention_mask=mask[:4], generation_config=cfg)  # warm-up
        padded = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            padded.append(time.perf_counter() - start)
        batched = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)
            batched.append(time.perf_counter() - start)
    produced = sum(len(o.generated_tokens) for o in out.values())
    print(f"padded generate:     {total / min(padded):10.0f} tokens/s (best of {args.repeats})")
    print(f"continuous batching: {produced / min(batched):10.0f} tokens/s (best of {args.repeats}, {produced} tokens)")


if __name__ == "__main__":
    main()
