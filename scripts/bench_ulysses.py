"""Long-sequence memory of Ulysses sequence parallelism: peak memory per rank of one actor update pass (packed row,
fused log-prob head, FSDP2 over all ranks, gradient checkpointing) with `ulysses_size` K against the same ranks
without the split (every rank then holds a whole sequence, as a data-parallel rank does).

Usage (its own script: it takes the model folder from `scripts/benchmark.py`, which does not import it back):
    python scripts/bench_ulysses.py --response 8192 --ulysses 2            # CPU: gloo, tiny-shaped model
    python scripts/bench_ulysses.py --model 0.5b --response 16384 --ulysses 2  # K GPUs: nccl, Qwen2.5-0.5B shape

Peak memory: on CUDA the allocator's peak (`max_memory_allocated`) during the pass; on CPU the process's peak
resident memory during the pass above its resident memory before it (Linux `clear_refs`), so model weights and
imports are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _batch(prompt: int, response: int, vocab: int, seed: int) -> Any:
    """One sample: `prompt` + `response` random tokens (the layout the engines emit, no padding)."""
    import torch

    from easyrl.batch import Batch

    g = torch.Generator().manual_seed(seed)
    length = prompt + response
    ids = torch.randint(3, vocab, (1, length), generator=g)
    mask = torch.ones(1, length, dtype=torch.long)
    return Batch(
        {
            "responses": ids[:, prompt:],
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(length)[None],
            "response_mask": mask[:, prompt:].clone(),
        }
    )


def _rank(rank: int, world: int, args: argparse.Namespace, model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.distributed.device import use_process_device
    from easyrl.distributed.memory import _cpu_peak_bytes, _reset_cpu_peak
    from easyrl.workers.forward_backward import token_log_probs
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.packing import packed_attn_implementation
    from easyrl.workers.specs import ForwardOptions
    from easyrl.workers.ulysses import enable_sequence_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = use_process_device()  # this rank's own GPU (LOCAL_RANK: the script sees every GPU), before NCCL binds
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    attn = packed_attn_implementation()
    sp = enable_sequence_parallel(args.sp, attn) if args.sp > 1 else None
    attn = sp.attn_implementation if sp is not None else attn
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(ModelConfig(model_path=model_dir), dtype=dtype, attn_implementation=attn)
    if sp is not None:
        sp.attach(model)
    model = shard_model(model, FSDPConfig(), device, gradient_checkpointing=True).train()
    opts = ForwardOptions(padding_free=True, fused=True, chunk_size=1024, ulysses_size=args.sp)
    mb = _batch(args.prompt, args.response, min(1000, model.config.vocab_size), seed=rank // args.sp)
    figures = []
    for _ in range(2):  # the first pass warms the allocator up; the second is measured
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _cpu_peak_bytes() if _reset_cpu_peak() else 0
        start = time.perf_counter()
        lp, _ = token_log_probs(model, mb, device, 1.0, with_entropy=False, opts=opts)
        (-lp.sum() / lp.numel()).backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = _cpu_peak_bytes() - base
        figures.append({"peak_gib": peak / 2**30, "seconds": time.perf_counter() - start})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, figures[-1])
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace, model_dir: str, sp: int, work: Path) -> list[dict[str, float]]:
    """Per-rank figures of one measured pass with `ulysses_size` = `sp` over `args.ulysses` ranks."""
    import torch.multiprocessing as mp

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    out = work / f"sp{sp}.json"
    mp.spawn(
        _rank,
        args=(args.ulysses, argparse.Namespace(**{**vars(args), "sp": sp}), model_dir, str(out)),
        nprocs=args.ulysses,
        join=True,
    )
    return json.loads(out.read_text())


def build_model(work: Path, size: str) -> str:
    from easyrl.testing.tiny import build_model as build_tiny

    if size == "tiny":  # 8 heads (so up to 8-way splits), hidden 256, 4 layers
        return build_tiny(
            work / "tiny_long",
            num_heads=8,
            num_kv_heads=2,
            hidden_size=256,
            num_layers=4,
            intermediate_size=512,
            max_position_embeddings=1 << 17,
        )
    from benchmark import build_model_dir  # type: ignore[import-not-found]

    return build_model_dir(work / f"model_{size}", size)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(work, args.model)
    result: dict[str, Any] = {
        "model": args.model,
        "prompt": args.prompt,
        "response": args.response,
        "ranks": args.ulysses,
    }
    for sp in (1, args.ulysses):
        ranks = measure(args, model_dir, sp, work)
        result[f"sp{sp}"] = ranks
        peak = max(r["peak_gib"] for r in ranks)
        secs = max(r["seconds"] for r in ranks)
        print(f"ulysses_size={sp}: peak memory per rank {peak:.3f} GiB (max over {len(ranks)} ranks), {secs:.2f} s")
    one, split = (max(r["peak_gib"] for r in result[f"sp{s}"]) for s in (1, args.ulysses))
    result["peak_ratio"] = split / one if one else float("nan")
    print(f"peak per rank, ulysses_size={args.ulysses} vs 1: {result['peak_ratio']:.3f}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (CPU) or a Qwen2.5 size of scripts/benchmark.py")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=8192)
    ap.add_argument("--ulysses", type=int, default=2, help="the split, and the number of ranks of both runs")
    ap.add_argument("--workdir", default="/tmp/easyrl_benchmark")
    return ap.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
