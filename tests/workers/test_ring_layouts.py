"""Ring attention composed with Ulysses is layout-invariant on 4 gloo ranks: ring 2 (2 data-parallel groups), Ulysses
2 (2 groups) and ring 2 x Ulysses 2 (one group of 4) give the one-rank results.

* Text, tiny Qwen2 (4 query heads, 2 key/value), packed rows of very unequal length: one optimizer step of the actor's
  real objective (`tests.workers.test_layout_invariance._step`): the updated weights, the loss and every metric
  (grad norm included), and the log-probs and entropy of the batch.
* Vision-language, tiny Qwen2.5-VL, one row whose prompt holds a synthetic video of 1,000 frames (16 x 16 pixels, one
  token per two frames: 500 video tokens) beside a text-only row: log-probs, entropy, loss, every parameter's
  gradient (vision tower included) and the weights after one SGD step. This is issue 47 item 5's first proof: a
  video of >= 1,000 frames trains with ring 2 x Ulysses 2 over 4 ranks and equals the one-rank run.

Both compute the one-rank reference once, in the test, and fork the 4 ranks from one fresh process (`_fork_ranks`):
the video proof takes ~23 CPU-s instead of ~47 and runs in `make test` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_layout_invariance import _batch, _step, _with_old_log_probs


CPU = torch.device("cpu")
WORLD = 4
LAYOUTS = {"ring2": (1, 2), "ulysses2": (2, 1), "ring2xulysses2": (2, 2)}
"""name -> (ulysses_size, ring_size)."""
FRAMES = 1000
VIDEO_CFG = SimpleNamespace(min_pixels=16 * 16, max_pixels=16 * 16, video_fps=10.0, max_frames=FRAMES, limit_images=0)
"""Every frame of the 10 fps video is kept (1,000 frames, the issue's floor) at 16 x 16, the smallest size the tiny
processor takes: 2 x 2 patches of 8 pixels a frame pair, one merged token per 2 frames."""


def _close(got: torch.Tensor, want: torch.Tensor) -> str | None:
    try:
        torch.testing.assert_close(got.detach(), want.detach(), atol=2e-5, rtol=1e-4)
    except AssertionError as exc:
        return " ".join(str(exc).splitlines()[:3])
    return None


def _log_probs(model_dir: str, rows: Batch, opts: ForwardOptions) -> tuple[torch.Tensor, torch.Tensor]:
    from easyrl.config import ModelConfig
    from easyrl.workers.forward_backward import token_log_probs
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    attn = register_varlen_attention()
    sp = enable_sequence_parallel(opts.ulysses_size, attn, opts.ring_size) if opts.sp_size > 1 else None
    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=sp.attn_implementation if sp else attn)
    if sp is not None:
        sp.attach(model)
    with torch.no_grad():
        lp, ent = token_log_probs(model, rows, CPU, 1.0, with_entropy=True, opts=opts)
    assert ent is not None
    return lp, ent


def _text_worker(
    rank: int,
    world: int,
    model_dir: str,
    batch: Batch,
    single: dict[str, Any],
    single_lp: list[torch.Tensor],
    out: str,
) -> None:
    init_rank(rank, world)
    failures: list[str] = []
    for name, (ulysses, ring) in LAYOUTS.items():
        opts = ForwardOptions(padding_free=True, ulysses_size=ulysses, ring_size=ring)
        groups = world // opts.sp_size
        part = rank // opts.sp_size
        rows = batch.chunk(groups)[part]  # a sequence-parallel group shares its data-parallel chunk
        got = _step(model_dir, rows, "actor", "token-mean", opts, 8)
        lp, ent = _log_probs(model_dir, rows, opts)
        mask = rows["response_mask"].bool()
        chunk = len(batch) // groups
        want_lp, want_ent = (t[part * chunk : (part + 1) * chunk] for t in single_lp)
        checks = {
            "params": (got["params"], single["params"]),
            "lp": (lp[mask], want_lp[mask]),
            "entropy": (ent[mask], want_ent[mask]),
        }
        checks |= {k: (torch.tensor(got["metrics"][k]), torch.tensor(v)) for k, v in single["metrics"].items()}
        failures += [f"text {name} {k}: {e}" for k, (a, b) in checks.items() if (e := _close(a, b)) is not None]
        if single["change"] < 1e-3:
            failures.append(f"text {name}: the step moved nothing ({single['change']})")
    _report(rank, world, failures, out)


def _report(rank: int, world: int, failures: list[str], out: str) -> None:
    """Every rank's failures, written by rank 0 to `out` (JSON)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, failures)
    if rank == 0:
        Path(out).write_text(json.dumps([f for part in gathered for f in part]))
    close_rank()


def _fork_ranks(_rank: int, _world: int, worker: Any, world: int, *args: Any) -> None:
    """Started alone by `run_ranks` (a fresh interpreter: no thread pool, no lock held by another thread): imports
    what the ranks run once, then forks the `world` ranks of `worker`. Spawned ranks each paid the ~8 CPU-s of
    importing torch, transformers and their dependencies again, most of these tests' time on a 2-core machine; the
    one-rank reference, once run on every rank, is computed once by the test and handed in."""
    import transformers

    import easyrl.workers.ring
    import easyrl.workers.ulysses  # noqa: F401
    from easyrl.workers.model_setup import load_model  # noqa: F401

    transformers.Qwen2_5_VLForConditionalGeneration  # noqa: B018  (the lazy module imports the model's code here)
    mp.start_processes(worker, args=(world, *args), nprocs=world, join=True, start_method="fork")


def test_text_step_is_the_same_with_ring_and_ulysses(tmp_path: Path) -> None:
    from easyrl.testing.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    batch = _with_old_log_probs(model_dir, _batch())
    packed = ForwardOptions(padding_free=True)
    single = _step(model_dir, batch, "actor", "token-mean", packed, 8)
    single_lp = list(_log_probs(model_dir, batch, packed))
    out = tmp_path / "failures.json"
    run_ranks(_fork_ranks, 1, _text_worker, WORLD, model_dir, batch, single, single_lp, str(out))
    assert json.loads(out.read_text()) == []


def _write_long_video(path: Path) -> None:
    """FRAMES frames at 10 fps of a bar whose colour changes every 100 frames."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for i in range(FRAMES):
            arr = np.zeros((16, 16, 3), np.uint8)
            arr[:, : 1 + i % 16] = ((i // 100) * 40 % 256, 255 - (i // 100) * 20, 128)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _vl_batch(model_dir: str, video: str) -> Batch:
    """Two rows: a prompt with the long video, and a text-only one; right-padded responses of 6 and 3 tokens."""
    from easyrl.data.multimodal import encode_multimodal_prompt
    from easyrl.models import load_processor

    processor = load_processor(model_dir)
    prompts = [("Which colour comes last in <video>?", [video]), ("No video here.", [])]
    responses = ["blue!!", "red"]
    encoded = [
        encode_multimodal_prompt(processor, [{"role": "user", "content": text}], [], videos, VIDEO_CFG)
        for text, videos in prompts
    ]
    p, r = max(len(e["input_ids"]) for e in encoded), max(map(len, responses))
    ids = torch.full((len(prompts), p + r), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, (e, resp) in enumerate(zip(encoded, responses)):
        n = len(e["input_ids"])
        ids[row, p - n : p] = torch.tensor(e["input_ids"])
        ids[row, p : p + len(resp)] = torch.tensor([ord(c) for c in resp])
        mask[row, p - n : p + len(resp)] = 1
    g = torch.Generator().manual_seed(0)
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, p:],
        "response_mask": mask[:, p:].clone(),
        "loss_mask": mask[:, p:].clone(),
        "advantages": torch.randn(len(prompts), r, generator=g),
    }
    return Batch(tensors, {"multi_modal_inputs": [e["multi_modal_inputs"] for e in encoded]})


def _vl_pass(model_dir: str, mb: Batch, opts: ForwardOptions) -> dict[str, torch.Tensor]:
    """Log-probs, entropy and loss of `mb`, the full gradients, and the full weights after one SGD step (lr 1)."""
    import torch.distributed as dist

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.model_setup import iter_full_weights, load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention
    from tests.workers.test_ulysses import _loss

    attn = register_varlen_attention()
    sp = enable_sequence_parallel(opts.ulysses_size, attn, opts.ring_size) if opts.sp_size > 1 else None
    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=sp.attn_implementation if sp else attn)
    if sp is not None:
        sp.attach(model)
    if dist.is_initialized():
        model = shard_model(model, FSDPConfig(), CPU)
    lp, ent, loss = _loss(model.train(), mb, opts)
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    mask = mb["response_mask"].bool()
    return {
        "lp": lp[mask].detach(),
        "entropy": ent[mask].detach(),
        "loss": loss.detach(),
        "grads": torch.cat([g.reshape(-1) for g in grads]),
        "params": torch.cat([t.reshape(-1) for _, t in iter_full_weights(model)]),
    }


def _vl_worker(rank: int, world: int, model_dir: str, mb: Batch, single: dict[str, torch.Tensor], out: str) -> None:
    init_rank(rank, world)
    failures: list[str] = []
    for name, (ulysses, ring) in LAYOUTS.items():
        opts = ForwardOptions(padding_free=True, fused=True, chunk_size=64, ulysses_size=ulysses, ring_size=ring)
        got = _vl_pass(model_dir, mb, opts)  # every data-parallel group holds the same row: the mean is the row's
        failures += [f"vl {name} {k}: {e}" for k in single if (e := _close(got[k], single[k])) is not None]
    _report(rank, world, failures, out)


def test_long_video_step_is_the_same_with_ring_and_ulysses(tmp_path: Path) -> None:
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint, make_vl_tokenizer

    model_dir = build_tiny_vl_checkpoint(tmp_path / "vl", "qwen2_5_vl")
    video = tmp_path / "long.mp4"
    _write_long_video(video)
    mb = _vl_batch(model_dir, str(video))
    video_pad = make_vl_tokenizer().convert_tokens_to_ids("<|video_pad|>")
    assert int((mb["input_ids"] == video_pad).sum()) == FRAMES // 2  # every frame reached the model, 2 a token
    single = _vl_pass(model_dir, mb, ForwardOptions(padding_free=True, fused=True, chunk_size=64))
    out = tmp_path / "failures.json"
    run_ranks(_fork_ranks, 1, _vl_worker, WORLD, model_dir, mb, single, str(out))
    assert json.loads(out.read_text()) == []
