"""Forward + backward time of one micro-batch through the three attention layouts the actor can use.

    python scripts/bench_packed_attention.py                 # CPU, fp32, small Qwen2
    python scripts/bench_packed_attention.py --device cuda --dtype bf16 --hidden 1536 --layers 4 --seqs 32 --len 512

* padded: left-padded prompts + right-padded responses, sdpa with the padding mask (the plain path);
* packed sdpa: padding-free row, transformers' sdpa with the block-diagonal mask it derives from the position ids
  (attention over the whole packed row);
* packed varlen: padding-free row, easyrl's ``easyrl_varlen`` attention (per-sequence; torch's flash varlen kernel on
  CUDA).

Sequence lengths are uniform in [len/4, len]; the loss is the sum of the response log-probs, as in the actor update.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=16, help="sequences in the micro-batch")
    ap.add_argument("--len", type=int, default=512, help="longest sequence (prompt + response)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from easyrl.batch import Batch
    from easyrl.workers.forward_backward import token_log_probs
    from easyrl.workers.specs import ForwardOptions
    from easyrl.workers.varlen import register_varlen_attention

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        intermediate_size=4 * args.hidden,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device, dtype).train()

    g = torch.Generator().manual_seed(0)
    prompt_w, resp_w = args.len // 2, args.len // 2
    mask = torch.zeros(args.seqs, prompt_w + resp_w, dtype=torch.long)
    for i in range(args.seqs):
        total = int(torch.randint(args.len // 4, args.len + 1, (), generator=g))
        p = max(1, total // 2)
        mask[i, prompt_w - p : prompt_w] = 1
        mask[i, prompt_w : prompt_w + total - p] = 1
    ids = torch.randint(3, cfg.vocab_size, mask.shape, generator=g) * mask
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt_w:],
            "response_mask": mask[:, prompt_w:].clone(),
        }
    )

    def step(opts: ForwardOptions | None) -> float:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        lp, _ = token_log_probs(model, batch, device, 1.0, with_entropy=False, opts=opts)
        (lp * batch["response_mask"].to(device)).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    tokens = int(mask.sum())
    print(f"{args.seqs} sequences, {tokens} valid tokens of {mask.numel()} padded; {args.device} {args.dtype}")
    layouts = [("padded (sdpa + padding mask)", "sdpa", None)]
    layouts.append(("packed sdpa (block mask)", "sdpa", ForwardOptions(padding_free=True)))
    layouts.append(("packed easyrl_varlen", register_varlen_attention(), ForwardOptions(padding_free=True)))
    for name, attn, opts in layouts:
        model.set_attn_implementation(attn)
        step(opts)  # warm-up
        times = [step(opts) for _ in range(args.repeats)]
        med = statistics.median(times)
        print(f"{name:32s} fwd+bwd median {med * 1000:9.1f} ms   {tokens / med:10.0f} valid tokens/s")


if __name__ == "__main__":
    main()
