"""Probe vLLM's Gated DeltaNet prefill kernels on this GPU: does a tiny Qwen3.5 generate with each backend?

The question it answers (docs/models.md, "vLLM's Gated DeltaNet prefill kernel"): does Qwen3.5 fail through vLLM on
Hopper because, with `gdn_prefill_backend` unset ("auto"), vLLM runs FlashInfer's GDN prefill kernel, whose
`flashinfer` import (and SM90 JIT compile) happens at the first real prefill, after a start-up warm-up that swallowed
the same failure? For each linear-attention head size (128 as published, 32 as the tiny test models) and each backend
(auto: vLLM's choice; triton) it starts `vllm.LLM` in a process of its own (enforce_eager, compilation mode 0, a
small share of the GPU, the rest as easyrl's engine sets it) and generates a few tokens from a short prompt. One line
per case: backend, head size, ok or the exception's type, message and last frames, and seconds; then vLLM's own log
lines about the GDN kernel. Always exits 0; without CUDA it says so in one line and runs nothing.

    python scripts/probe_gdn.py                          # 4 cases, ~30-60 s each (vLLM start-up dominates)
    python scripts/probe_gdn.py --heads 128 --backends auto --timeout 60   # the one case in question
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # easyrl's tiny model builder, run from anywhere

RESULT = "PROBE_RESULT "
"""Prefix of the one line a case's process prints with its outcome (JSON)."""
VLLM_LINES = ("GDN prefill", "FlashInfer", "flashinfer", "Error:")
"""Output lines worth showing under a case: vLLM's kernel choice, the JIT warning, a failed warm-up, and errors (also
those of vLLM's helper processes, which the case's exception only points at)."""
MAX_LINES = 12
"""At most this many of them per case."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[128, 32], help="linear_key/value_head_dim values")
    parser.add_argument("--backends", nargs="+", default=["auto", "triton"], help="auto (unset), triton, flashinfer")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per case (start-up included)")
    parser.add_argument("--case", nargs=3, metavar=("MODEL", "BACKEND", "HEAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # one case, in this (child) process
        _run_case(args.case[0], args.case[1], int(args.case[2]))
        return
    import torch

    if not torch.cuda.is_available():
        print("probe_gdn: no CUDA device here; this probe runs vLLM's GDN prefill kernels on a GPU: nothing run")
        return
    import vllm

    cap = torch.cuda.get_device_capability()
    print(
        f"probe_gdn: {torch.cuda.get_device_name()} (SM{cap[0]}{cap[1]}), vllm {vllm.__version__}, torch "
        f"{torch.__version__}, flashinfer importable: {importlib.util.find_spec('flashinfer') is not None}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="probe_gdn_") as root:
        for head in args.heads:
            model = _build(Path(root) / f"qwen3_5_h{head}", head)
            for backend in args.backends:
                _probe(model, backend, head, args.timeout)


def _build(path: Path, head: int) -> str:
    """The tiny Qwen3.5 (layer 0 Gated DeltaNet, layer 1 full attention) with linear-attention heads of `head`."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    overrides = {"linear_key_head_dim": head, "linear_value_head_dim": head}
    return build_tiny_vl_checkpoint(path, "qwen3_5", text_overrides=overrides)


def _probe(model: str, backend: str, head: int, timeout: float) -> None:
    """Run one case in a fresh process (a failed engine leaves its process's CUDA state behind) and print its line."""
    start = time.perf_counter()
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # in-process engine: its exception reaches the case
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the sampler's FlashInfer is not the question here
    cmd = [sys.executable, __file__, "--case", model, backend, str(head)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = _text(exc.stdout) + _text(exc.stderr), None
    seconds = time.perf_counter() - start
    lines = output.splitlines()
    found = [json.loads(line[len(RESULT) :]) for line in lines if line.startswith(RESULT)]
    if found:
        outcome = found[-1]["outcome"]
    elif code is None:
        outcome = f"TIMEOUT after {timeout:g} s (no result)"
    else:
        outcome = f"DIED with exit code {code} (no result); last output: {' | '.join(lines[-3:])}"
    print(f"backend={backend:<10} head={head:<4} {outcome} [{seconds:.1f} s]", flush=True)
    shown = list(dict.fromkeys(ln.strip() for ln in lines if any(k in ln for k in VLLM_LINES) and RESULT not in ln))
    for line in shown[:MAX_LINES]:
        print(f"    output: {line[:300]}", flush=True)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _run_case(model: str, backend: str, head: int) -> None:
    """Start the engine as easyrl's does for this model on a GPU (tokenizer on, one image a prompt, so the vision tower
    is built), generate 8 tokens greedily from a short prompt, and print the outcome as one JSON line."""
    start = time.perf_counter()
    try:
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = {
            "model": model,
            "tokenizer": model,
            "skip_tokenizer_init": False,
            "dtype": "bfloat16",
            "seed": 0,
            "max_model_len": 256,
            "enforce_eager": True,
            "compilation_config": {"mode": 0},
            "gpu_memory_utilization": 0.15,
            "limit_mm_per_prompt": {"image": 1, "video": 0},
        }
        if backend != "auto":
            kwargs["gdn_prefill_backend"] = backend
        llm = LLM(**kwargs)
        started = time.perf_counter() - start
        ids = AutoTokenizer.from_pretrained(model)("Copy: 1 2 3 4 5 6 7 8 9")["input_ids"]
        params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
        generated = time.perf_counter() - start - started
        outcome = f"ok: {len(tokens)} tokens (start {started:.1f} s, generate {generated:.1f} s)"
    except BaseException as exc:  # the probe reports whatever happens, SystemExit included
        outcome = f"FAILED {_describe(exc)}"
    print(RESULT + json.dumps({"outcome": outcome}), flush=True)
    os._exit(0)  # an engine mid-failure may hang at interpreter exit


def _describe(exc: BaseException) -> str:
    """`Type: message` of the exception and of its causes, and the last frames of the innermost one."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain or len(chain) > 4:
            break
        chain.append(nxt)
    parts = [f"{type(e).__name__}: {' '.join(str(e).split())[:300]}" for e in chain]
    frames = traceback.extract_tb(chain[-1].__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return " <- caused by ".join(parts) + (f" | at {where}" if where else "")


if __name__ == "__main__":
    main()
