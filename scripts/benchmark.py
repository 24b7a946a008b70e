"""Training-throughput benchmark: the real trainer (GRPO + reference model) on random-weight Qwen2.5-shaped models.

Usage:
    python scripts/benchmark.py --model 0.5b                  # one GPU, shape S, 2 warm-up + 10 measured steps
    python scripts/benchmark.py --model 1.5b --dynamic-batching --padding-free --fused-logprobs
    python scripts/benchmark.py --tiny --steps 1 --warmup 0   # CPU smoke run (2 workers, HF engine)

Models are built from the public Qwen2.5 configs (vocabulary 151936) with random weights and the tiny
character tokenizer of `easyrl.testing.tiny`; prompts are random characters (one token each), so prompt token
ids fall in the tokenizer's small range while the model keeps its full vocabulary (softmax cost unchanged).

Shape S: 128 prompts x n=8, 256-token prompts, responses uniform in 128..512 tokens, 4 mini-batches.
Per-sample response lengths: `SamplingParams` has one `max_tokens`, so the engine generates `max` tokens for every
sample (`ignore_eos`) and a user module (loaded in every worker through `algorithm.user_modules`) truncates each
response to a length drawn uniformly in [min, max] right after generation (masks and pad ids updated). Generation
time therefore covers `max` tokens per sample; training sees the uniform lengths.

Reported: median and p90 over the measured steps of every `timing_s/*`, the vLLM-vs-actor log-prob difference,
the GPU memory sleeping gave back (`perf/sleep_freed_gb`), `perf/throughput` (tokens per second per
GPU over the whole step), generation tokens/s (`n_samples * max_tokens / timing_s/gen`), the actor-update MFU and
peak GPU memory; then raw vLLM tokens/s on the same prompts (same engine settings, no trainer around it).

MFU of the actor update (`update_actor` time, `ppo_epochs` passes; recomputation by gradient checkpointing is not
counted, as usual for MFU). With T = valid tokens (prompt + response) per update, s_i the length of sequence i,
L layers, H hidden size, V vocabulary, N_body the non-embedding parameters (attention + MLP + norms):
    verl's formula:  F = 6 * (N_body + 2 * V * H) * T + 12 * L * H * sum_i s_i^2
        (counts the embedding as a matmul and the head separately even when they are tied)
    true formula:    F = 6 * (N_body + V * H) * T + 12 * L * H * sum_i s_i^2
        (the embedding lookup does no FLOPs; the head matmul, tied or not, once)
    MFU = F / (update seconds * peak FLOP/s * GPUs); peak: --peak-tflops (H100 SXM dense bf16: 989).
sum_i s_i^2 is estimated from the logged mean prompt and response lengths (n_samples * (P + R)^2: a lower bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QWEN25 = {  # public Qwen2.5 configs (config.json on the hub); all tie the embedding and the head up to 3B
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "tie_word_embeddings": True},
    "3b": {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
           "intermediate_size": 11008, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 128, "tie_word_embeddings": True},
}  # fmt: skip
VOCAB = 151936

TRUNCATE_MODULE = '''"""Benchmark only: truncate each generated response to a length uniform in [{lo}, {hi}]."""
import torch
from easyrl.workers.rollout import hf as _hf

def _wrap(cls):
    original = cls.generate
    def generate(self, prompts, params):
        out = original(self, prompts, params)
        r = out["responses"].shape[1]
        p = out["input_ids"].shape[1] - r
        g = torch.Generator().manual_seed(int(params.seed or 0))
        lengths = torch.randint({lo}, {hi} + 1, (len(out),), generator=g).clamp(max=r)
        keep = torch.arange(r)[None, :] < lengths[:, None]
        out.tensors["response_mask"] = out["response_mask"] * keep
        out.tensors["attention_mask"][:, p:] *= keep
        out.tensors["responses"] = torch.where(keep, out["responses"], {pad})
        out.tensors["input_ids"][:, p:] = out.tensors["responses"]
        return out
    cls.generate = generate

_wrap(_hf.HFRolloutEngine)
try:
    from easyrl.workers.rollout import vllm as _vllm
    _wrap(_vllm.VLLMRolloutEngine)
except ImportError:
    pass
'''

REWARD_FILE = '''"""Benchmark only: a random score per response (GRPO needs non-constant rewards to have gradients)."""
import random

def compute_score(reward_inputs, **kwargs):
    return [{"overall": random.random()} for _ in reward_inputs]
'''


def build_model_dir(folder: Path, size: str) -> tuple[str, dict[str, Any]]:
    """A random-init Qwen2.5-shaped model with the tiny tokenizer, saved as a HF folder (reused if present)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from easyrl.testing.tiny import make_generation_config, make_tokenizer, padded_vocab_size

    tok = make_tokenizer()
    shape = dict(QWEN25[size])
    vocab = padded_vocab_size(tok) if size == "tiny" else VOCAB
    cfg = Qwen2Config(
        vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape,
    )  # fmt: skip
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        dtype = torch.float32 if size == "tiny" else torch.bfloat16
        model = Qwen2ForCausalLM(cfg).to(dtype)
        model.generation_config = make_generation_config(tok)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder), {**shape, "vocab_size": vocab}


def write_inputs(run: Path, n_prompts: int, prompt_len: int, lo: int, hi: int, pad: int) -> dict[str, str]:
    """Random-character prompts, the truncation module and the random reward."""
    import random

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    rows = [
        {"prompt": "".join(rng.choice(alphabet) for _ in range(prompt_len)), "answer": "x"} for _ in range(n_prompts)
    ]
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "truncate.py").write_text(TRUNCATE_MODULE.format(lo=lo, hi=hi, pad=pad))
    (run / "reward.py").write_text(REWARD_FILE)
    return {"train": str(run / "train.jsonl"), "truncate": str(run / "truncate.py"), "reward": str(run / "reward.py")}


def make_config(args: argparse.Namespace, model_dir: str, files: dict[str, str], run: Path) -> dict[str, Any]:
    """The trainer config of the benchmark."""
    gpu = not args.tiny
    return {
        "data": {"train_files": files["train"], "val_files": "", "max_prompt_length": args.prompt_len + 32,
                 "max_response_length": args.max_response, "rollout_batch_size": args.prompts},
        "algorithm": {"adv_estimator": "grpo", "disable_kl": False, "use_kl_loss": True,
                      "user_modules": [files["truncate"]]},
        "worker": {
            "actor": {
                "global_batch_size": args.prompts // args.mini_batches,
                "micro_batch_size_per_device_for_update": args.micro_update,
                "micro_batch_size_per_device_for_experience": args.micro_experience,
                "dynamic_batching": args.dynamic_batching, "max_token_len_per_gpu": args.max_token_len,
                "padding_free": args.padding_free, "fused_logprobs": args.fused_logprobs,
                "optim": {"lr": 1e-6, "strategy": args.optim},
                "offload": {"offload_params": args.offload, "offload_optimizer": args.offload},
                "model": {"model_path": model_dir, "enable_gradient_checkpointing": gpu},
            },
            "rollout": {"name": args.engine, "n": args.n, "temperature": 1.0, "ignore_eos": True,
                        "dtype": "bf16" if gpu else "fp32", "gpu_memory_utilization": args.gpu_memory_utilization,
                        "sleep_level": args.sleep_level, "enforce_eager": args.enforce_eager,
                        "logprob_sample_ratio": args.logprob_sample_ratio},
            "reward": {"reward_function": files["reward"] + ":compute_score", "num_workers": 0},
        },
        "trainer": {"total_epochs": 1000, "max_steps": args.warmup + args.steps, "n_gpus_per_node": args.gpus,
                    "logger": ["file"], "val_before_train": False, "save_freq": -1,
                    "save_checkpoint_path": str(run / "out"), "device": "cuda" if gpu else "cpu"},
    }  # fmt: skip


def quantiles(values: list[float]) -> tuple[float, float]:
    """(median, p90) of `values` (nearest-rank p90)."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def update_flops(shape: dict[str, Any], rows: list[dict[str, float]], n_samples: int) -> tuple[float, float]:
    """Per-step FLOPs of one actor-update pass: (verl's formula, the true one); see the module docstring."""
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    # per layer: q and o (h x h), k and v (h x kv), q/k/v biases, gate/up/down MLP, two RMSNorms; then the final norm
    body = layers * (2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * shape["intermediate_size"] + 2 * h) + h
    out = []
    for row in rows:
        seq = row.get("prompt_length/mean", 0.0) + row.get("response_length/mean", 0.0)
        tokens = n_samples * seq
        attn = 12 * layers * h * n_samples * seq**2
        out.append((6 * (body + 2 * v * h) * tokens + attn, 6 * (body + v * h) * tokens + attn))
    return statistics.median(f for f, _ in out), statistics.median(f for _, f in out)


def raw_vllm_tokens_per_s(args: argparse.Namespace, model_dir: str, prompts: list[str]) -> float:
    """vLLM alone on the same prompts: n samples each, `max_response` tokens (ignore_eos)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    llm = LLM(model=model_dir, dtype="bfloat16" if not args.tiny else "float32", seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.prompt_len + 32 + args.max_response)  # fmt: skip
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_response, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(x)} for x in ids[:2]], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(x)} for x in ids], params)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed


def train(run: Path, config: dict[str, Any], num_cpus: int | None) -> list[dict[str, float]]:
    """Train with ``config`` (saved as ``run/cfg.yaml``; it logs to ``run/out``) and return the logged rows."""
    import yaml

    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import init_ray
    from easyrl.trainer.trainer import Trainer

    (run / "cfg.yaml").write_text(yaml.safe_dump(config))
    init_ray(num_cpus=num_cpus)
    trainer = Trainer(*load_config_and_secrets(str(run / "cfg.yaml")))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [json.loads(line) for line in (run / "out" / "experiment_log.jsonl").read_text().splitlines()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b", choices=[k for k in QWEN25 if k != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 2 CPU workers, small shape")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engine", default=None, help="vllm (default on GPU) or hf (default with --tiny)")
    ap.add_argument("--raw-vllm", action=argparse.BooleanOptionalAction, default=None,
                    help="also time raw vLLM (default: on unless --tiny)")  # fmt: skip
    ap.add_argument("--dynamic-batching", action="store_true")
    ap.add_argument("--max-token-len", type=int, default=16384)
    ap.add_argument("--padding-free", action="store_true")
    ap.add_argument("--fused-logprobs", action="store_true")
    ap.add_argument("--offload", action="store_true", help="offload actor params/optimizer around generation")
    ap.add_argument("--optim", default="adamw", choices=["adamw", "adamw_bf16"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--sleep-level", type=int, default=1, choices=[1, 2], help="vLLM sleep level (2: drop weights)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in vLLM (the A/B's 'off')")
    ap.add_argument("--logprob-sample-ratio", type=float, default=0.125,
                    help="share of sequences whose vLLM log-probs are returned (consistency metric)")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--workdir", default="/tmp/easyrl_benchmark")
    args = ap.parse_args(argv)
    small = args.tiny
    args.engine = args.engine or ("hf" if small else "vllm")
    args.raw_vllm = (not small) if args.raw_vllm is None else args.raw_vllm
    args.gpus = 2 if small else 1
    args.prompts, args.n, args.prompt_len = (4, 2, 16) if small else (128, 8, 256)
    args.min_response, args.max_response = (4, 12) if small else (128, 512)
    args.mini_batches = 2 if small else 4
    args.micro_update, args.micro_experience = (2, 4) if small else (8, 32)
    return args


def report(args: argparse.Namespace, rows: list[dict[str, float]], shape: dict[str, Any]) -> dict[str, Any]:
    """Print and return the summary of the measured steps."""
    measured = rows[args.warmup :] or rows
    summary: dict[str, Any] = {}
    keys = sorted(
        {k for r in measured for k in r if k.startswith(("timing_s/", "rollout/logprob_diff"))}
        | {"perf/throughput", "perf/sleep_freed_gb"}
    )
    for key in keys:
        vals = [r[key] for r in measured if key in r]
        if vals:
            summary[key] = quantiles(vals)
    n_samples = args.prompts * args.n
    gen = [n_samples * args.max_response / r["timing_s/gen"] for r in measured if r.get("timing_s/gen")]
    summary["gen_tokens_per_s"] = quantiles(gen) if gen else (float("nan"),) * 2
    verl_f, true_f = update_flops(shape, measured, n_samples)
    upd = statistics.median(r["timing_s/update_actor"] for r in measured)
    peak = args.peak_tflops * 1e12 * args.gpus
    summary["mfu_update_verl"] = verl_f / upd / peak if not args.tiny else float("nan")
    summary["mfu_update_true"] = true_f / upd / peak if not args.tiny else float("nan")
    summary["peak_memory_gb"] = max((r.get("perf/max_memory_allocated_gb", 0.0) for r in measured), default=0.0)
    for key, value in summary.items():
        if isinstance(value, tuple):
            print(f"{key:40s} median {value[0]:12.4f}   p90 {value[1]:12.4f}")
        else:
            print(f"{key:40s} {value:12.4f}")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from easyrl.testing.tiny import make_tokenizer

    size = "tiny" if args.tiny else args.model
    work = Path(args.workdir)
    run = work / f"run_{size}_{int(time.time())}"
    run.mkdir(parents=True, exist_ok=True)
    model_dir, shape = build_model_dir(work / f"model_{size}", size)
    pad = int(make_tokenizer().pad_token_id)
    files = write_inputs(run, args.prompts, args.prompt_len, args.min_response, args.max_response, pad)
    rows = train(run, make_config(args, model_dir, files, run), num_cpus=4 if args.tiny else None)
    print(f"\n{size}: {len(rows)} steps ({args.warmup} warm-up), engine {args.engine}, run folder {run}")
    summary = report(args, rows, shape)
    if args.raw_vllm:
        import ray

        ray.shutdown()  # frees the workers' GPU memory for the standalone engine
        prompts = [json.loads(line)["prompt"] for line in Path(files["train"]).read_text().splitlines()]
        summary["raw_vllm_tokens_per_s"] = raw_vllm_tokens_per_s(args, model_dir, prompts)
        print(f"{'raw_vllm_tokens_per_s':40s} {summary['raw_vllm_tokens_per_s']:12.1f}")
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
