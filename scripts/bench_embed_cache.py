"""Video embedding cache on CPU: the vision tower's encode time of a few long synthetic videos in epoch 1 (nothing
cached: encode and write) against epoch 2 (read back from `data.cache_dir`), and without any cache.

Each epoch starts with an empty in-process memo (as a new run, or a data set larger than the memo, would), so epoch 2
measures the disk cache alone. The model is a tiny Qwen2.5-VL (`easyrl.testing.tiny_vl`) with a wider, deeper tower
than the tests' (so the tower, not the bookkeeping, dominates the no-cache time); the videos are random patches of
`--frames` frames of `--size` pixels, the layout the processor produces.

Usage:
    python scripts/bench_embed_cache.py                       # 4 videos x 128 frames, 64x64, tower 2 x 64
    python scripts/bench_embed_cache.py --videos 2 --frames 16 --size 32 --depth 1 --width 32   # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _videos(n: int, frames: int, size: int, patch_dim: int, patch: int) -> list[tuple[Any, Any]]:
    """`n` videos of `frames` frames (temporal patches of 2 frames) of `size` x `size` pixels, random patches."""
    import torch

    g = torch.Generator().manual_seed(0)
    side = size // patch
    grid = torch.tensor([frames // 2, side, side])
    return [(torch.randn(int(grid.prod()), patch_dim, generator=g), grid) for _ in range(n)]


def _epoch(reuse: Any, videos: list[tuple[Any, Any]]) -> float:
    import torch

    from easyrl.models import vl_embeds

    vl_embeds._MEMO.items.clear()  # a new run, or more videos than the memo holds: only the disk can serve
    vl_embeds._MEMO.bytes = 0
    start = time.perf_counter()
    with torch.no_grad():
        for pixels, grid in videos:
            reuse.features(pixels, grid[None])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, default=4)
    parser.add_argument("--frames", type=int, default=128, help="frames per video (even: 2 per temporal patch)")
    parser.add_argument("--size", type=int, default=64, help="frame side in pixels (a multiple of 16)")
    parser.add_argument("--depth", type=int, default=2, help="vision tower blocks")
    parser.add_argument("--width", type=int, default=64, help="vision tower width")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="folder for the model and the cache (default: a temp dir)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForImageTextToText

    from easyrl.models import vision_tower
    from easyrl.models.embed_cache import EmbedCache, tower_version
    from easyrl.models.vl_embeds import install_embed_reuse
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_embed_cache_"))
    heads = max(args.width // 32, 1)
    path = build_tiny_vl_checkpoint(
        work / "model",
        "qwen2_5_vl",
        vision_hidden_size=args.width,
        vision_depth=args.depth,
        vision_overrides={"num_heads": heads, "intermediate_size": 4 * args.width},
    )
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tower: Any = vision_tower(model)
    tower.requires_grad_(False)
    patch, temporal = int(tower.config.patch_size), int(tower.config.temporal_patch_size)
    videos = _videos(args.videos, args.frames, args.size, 3 * temporal * patch * patch, patch)
    version = tower_version(tower)
    settings = {"video_fps": 2.0, "max_frames": float(args.frames)}

    plain = install_embed_reuse(model, None)  # trained-tower mode: no memo, no disk; every epoch encodes
    assert plain is not None
    _epoch(plain, videos[:1])  # warm-up: first-call allocations and kernel selection are not the tower's cost
    no_cache = [_epoch(plain, videos) for _ in range(2)]
    cache = EmbedCache(work / "cache", max_gb=10.0)
    reuse = install_embed_reuse(model, version, cache, settings)
    assert reuse is not None
    first = _epoch(reuse, videos)
    hits_before = cache.hits
    second = _epoch(reuse, videos)
    result = {
        "videos": args.videos,
        "frames": args.frames,
        "size": args.size,
        "tower": f"{args.depth} x {args.width}",
        "tokens_per_video": int(videos[0][1].prod()) // 4,
        "no_cache_s": [round(t, 3) for t in no_cache],
        "epoch1_s": round(first, 3),
        "epoch2_s": round(second, 3),
        "speedup": round(first / second, 1),
        "epoch2_hits": cache.hits - hits_before,
        "encoded": reuse.encoded,
        "cache_mb": round(sum(size for _, size, _ in cache.entries()) / 2**20, 2),
        "threads": args.threads,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
