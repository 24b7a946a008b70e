"""Vision-language GRPO through the vLLM HybridEngine on one GPU, with GPU memory step by step.

Usage:
    python scripts/bench_vl.py                        # random-weight Qwen2.5-VL-3B, images, 1 warm-up + 5 steps
    python scripts/bench_vl.py --media video          # the same with a short video per prompt
    python scripts/bench_vl.py --tiny --steps 2       # CPU smoke run: tiny Qwen2.5-VL, 2 CPU workers, HF engine

The model has the public Qwen2.5-VL-3B-Instruct shape (config.json on the hub: text 2048 wide, 36 layers, 16/2 heads,
vocabulary 151936; vision tower 32 blocks, 1280 wide, 14-pixel patches, window attention) and random weights, with
the character tokenizer of `easyrl.testing.tiny` and a local image processor (nothing is downloaded). Prompts are
random characters after one generated image (sides 224..448 pixels: 64..256 image tokens) or one generated 4-second
video (sampled at 2 fps); responses are `--response` tokens (`ignore_eos`); the reward is random. GRPO with a
reference model (KL loss), n=8. By default the actor keeps AdamW's moments in bf16 (`adamw_bf16`) and the reference
its weights in bf16: with fp32 moments and an fp32 reference the 3.75B model needs ~87 GiB while generating at
utilization 0.4, more than an 80 GB H100 has (`easyrl check` prints that arithmetic and refuses the setting).

Printed: per step `timing_s/step|gen|update_actor`, the GPU memory the PyTorch allocator peaked at during the step
and holds after it, the device's memory in use after it, what the engine's sleep gave back, and the vLLM-vs-actor
log-prob difference; then the growth of the memory figures from the first measured step to the last (flat means
no leak: vLLM's multimodal caches are cleared at every sleep). A summary is kept as `summary.json` in the run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

QWEN25_VL_3B = {  # public Qwen2.5-VL-3B-Instruct config.json
    "text": {"hidden_size": 2048, "num_layers": 36, "num_heads": 16, "num_kv_heads": 2},
    "text_overrides": {"intermediate_size": 11008, "vocab_size": 151936, "max_position_embeddings": 128000,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                           "mrope_section": [16, 24, 24]}},
    "vision": {"vision_hidden_size": 1280, "vision_depth": 32},
    "vision_overrides": {"intermediate_size": 3420, "num_heads": 16, "window_size": 112,
                         "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 2048},
}  # fmt: skip
MEMORY_KEYS = ("perf/max_memory_allocated_gb", "perf/memory_allocated_gb", "perf/device_memory_used_gb")
STEP_KEYS = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", *MEMORY_KEYS, "perf/sleep_freed_gb",
             "rollout/logprob_diff_mean", "rollout/token_prob_error")  # fmt: skip


def build_model(folder: Path, tiny: bool) -> str:
    """The model folder (reused when present): Qwen2.5-VL-3B-shaped in bf16, or the tiny test model. The 3B model
    is built in a child process, so that the ~7.5 GiB it takes on the GPU go back to the device when the child exits
    (built in this process, the caching allocator kept them for the whole run, beside the engine and the workers)."""
    import subprocess

    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    if (folder / "config.json").exists():
        return str(folder)
    if tiny:
        return build_tiny_vl_checkpoint(folder, "qwen2_5_vl", min_pixels=16 * 16, max_pixels=64 * 64)
    subprocess.run([sys.executable, __file__, "--build-model-only", str(folder)], check=True)
    return str(folder)


def _build_3b(folder: Path) -> None:
    """The child process of `build_model`: random Qwen2.5-VL-3B weights written to `folder`."""
    import torch

    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    shape = QWEN25_VL_3B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init of 3.8B parameters is minutes on CPU, seconds on the GPU
        build_tiny_vl_checkpoint(
            folder, "qwen2_5_vl", min_pixels=224 * 224, max_pixels=448 * 448, patch_size=14, dtype=torch.bfloat16,
            **shape["text"], **shape["vision"], text_overrides=shape["text_overrides"],
            vision_overrides=shape["vision_overrides"],
        )  # fmt: skip


def write_data(run: Path, args: argparse.Namespace) -> dict[str, str]:
    """Rows of random characters after one generated image or video; the random reward."""
    import random

    import numpy as np
    from PIL import Image

    rng = random.Random(0)
    media = run / "media"
    media.mkdir()
    lo, hi = (32, 64) if args.tiny else (224, 448)
    rows = []
    for i in range(args.prompts):
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(args.prompt_chars))
        width, height = rng.randrange(lo, hi + 1), rng.randrange(lo, hi + 1)
        if args.media == "image":
            pixels = np.random.default_rng(i).integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(media / f"{i}.png")
            rows.append({"prompt": f"<image>{text}", "answer": "x", "images": [f"{i}.png"]})
        else:
            _write_video(media / f"{i}.mp4", width - width % 2, height - height % 2, seed=i)
            rows.append({"prompt": f"<video>{text}", "answer": "x", "videos": [f"{i}.mp4"]})
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "reward.py").write_text(
        "import random\n\n\ndef compute_score(reward_inputs, **kwargs):\n"
        "    return [{'overall': random.random()} for _ in reward_inputs]\n"
    )
    return {"train": str(run / "train.jsonl"), "media": str(media), "reward": str(run / "reward.py")}


def _write_video(path: Path, width: int, height: int, seed: int, seconds: int = 4, fps: int = 8) -> None:
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(seconds * fps):
            frame = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_config(args: argparse.Namespace, model_dir: str, files: dict[str, str], run: Path) -> dict[str, Any]:
    gpu = not args.tiny
    pixels = (16 * 16, 64 * 64) if args.tiny else (224 * 224, 448 * 448)
    return {
        "data": {"train_files": files["train"], "val_files": "", "image_dir": files["media"],
                 "video_dir": files["media"], "min_pixels": pixels[0], "max_pixels": pixels[1], "video_fps": 2.0,
                 "max_prompt_length": args.prompt_chars + (160 if args.tiny else 320),
                 "max_response_length": args.response, "rollout_batch_size": args.prompts},
        "algorithm": {"adv_estimator": "grpo", "disable_kl": False, "use_kl_loss": True},
        "worker": {
            "actor": {
                "global_batch_size": args.prompts // 2, "micro_batch_size_per_device_for_update": 4 if gpu else 2,
                "micro_batch_size_per_device_for_experience": 16 if gpu else 4,
                "optim": {"lr": 1e-6, "strategy": args.optim},
                "model": {"model_path": model_dir, "enable_gradient_checkpointing": gpu},
            },
            "ref": {"fsdp": {"torch_dtype": args.ref_dtype}},
            "rollout": {"name": args.engine, "n": args.n, "temperature": 1.0, "ignore_eos": True,
                        "dtype": "bf16" if gpu else "fp32", "gpu_memory_utilization": args.gpu_memory_utilization},
            "reward": {"reward_function": files["reward"] + ":compute_score", "num_workers": 0},
        },
        "trainer": {"total_epochs": 1000, "max_steps": args.warmup + args.steps, "n_gpus_per_node": 2 if args.tiny else 1,
                    "logger": ["file"], "val_before_train": False, "save_freq": -1,
                    "save_checkpoint_path": str(run / "out"), "device": "cuda" if gpu else "cpu"},
    }  # fmt: skip


def report(rows: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Print the per-step table and the memory growth over the measured steps; return the summary."""
    print("step " + " ".join(f"{k.split('/')[-1]:>22s}" for k in STEP_KEYS))
    for i, row in enumerate(rows, 1):
        print(f"{i:4d} " + " ".join(f"{row.get(k, float('nan')):22.3f}" for k in STEP_KEYS))
    measured = rows[warmup:] or rows
    summary: dict[str, Any] = {"steps": [{k: r[k] for k in STEP_KEYS if k in r} for r in rows]}
    for key in MEMORY_KEYS:
        values = [r[key] for r in measured if key in r]
        if values:
            summary[f"{key}_growth"] = values[-1] - values[0]
            print(f"{key + ' growth (first to last measured step)':60s} {values[-1] - values[0]:+.3f} GiB")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 2 CPU workers, HF engine")
    ap.add_argument("--media", default="image", choices=["image", "video"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64; 4 with --tiny)")
    ap.add_argument("--response", type=int, default=None, help="response tokens (default 256; 8 with --tiny)")
    ap.add_argument("--engine", default=None, help="vllm (default on GPU) or hf (default with --tiny)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--optim", default=None, choices=["adamw", "adamw_bf16"], help="default adamw_bf16 (adamw: tiny)")
    ap.add_argument("--ref-dtype", default=None, choices=["bf16", "fp32"], help="default bf16 (fp32: tiny)")
    ap.add_argument("--workdir", default="/tmp/easyrl_bench_vl")
    ap.add_argument("--build-model-only", default=None, help=argparse.SUPPRESS)  # build_model's child process
    args = ap.parse_args(argv)
    if args.build_model_only:
        _build_3b(Path(args.build_model_only))
        return {}
    args.engine = args.engine or ("hf" if args.tiny else "vllm")
    args.optim = args.optim or ("adamw" if args.tiny else "adamw_bf16")
    args.ref_dtype = args.ref_dtype or ("fp32" if args.tiny else "bf16")
    args.prompts = args.prompts or (4 if args.tiny else 64)
    args.response = args.response or (8 if args.tiny else 256)
    args.n, args.prompt_chars = (2, 8) if args.tiny else (8, 64)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from benchmark import train

    work = Path(args.workdir)
    run = work / f"run_{'tiny' if args.tiny else '3b'}_{args.media}_{int(time.time())}"
    run.mkdir(parents=True)
    start = time.perf_counter()
    model_dir = build_model(work / ("model_tiny" if args.tiny else "model_qwen2_5_vl_3b"), args.tiny)
    print(f"model ready in {time.perf_counter() - start:.1f} s: {model_dir}")
    files = write_data(run, args)
    rows = train(run, make_config(args, model_dir, files, run), num_cpus=4 if args.tiny else None)
    print(f"\n{len(rows)} steps ({args.warmup} warm-up), {args.media}s, engine {args.engine}, run folder {run}")
    summary = report(rows, args.warmup)
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
