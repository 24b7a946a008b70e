"""Vision-language micro-batches that differ in media across data-parallel ranks: rank 0's row has a video and an
image (two vision tower calls), rank 1's is text only (none). Without `easyrl.models.vl_tower` the ranks' FSDP2
collectives stop pairing up (gloo aborts: "Received data size doesn't match expected size"); with it each rank's
log-probs are those of the unsharded model, and the gradients are the ranks' average, the text-only rank adding zero
to every vision parameter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing_vl import _batch, _write_video


CPU = torch.device("cpu")
ROWS = ([1], [2])
"""Rows of `_batch` on each rank: a video and an image; text only."""


def _lp_grads(
    model: torch.nn.Module, mb: Batch, opts: ForwardOptions | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    from easyrl.workers.forward_backward import token_log_probs

    model.zero_grad(set_to_none=True)
    lp, _ = token_log_probs(model, mb, CPU, 1.0, False, opts)
    mask = mb["response_mask"].float()
    (-(lp * mb["advantages"] * mask).sum()).backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, world: int, model_dir: str, video: str, out: str) -> None:

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.models import load_processor
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.packing import packed_attn_implementation

    init_rank(rank, world)
    whole = _batch(load_processor(model_dir), Path(video))
    mbs = [whole.index(rows) for rows in ROWS]
    # The unsharded model, no hooks, each rank's micro-batch alone; a text-only row leaves vision gradients None.
    alone = [_lp_grads(load_model(ModelConfig(model_path=model_dir)).train(), mb, None) for mb in mbs]
    failures: list[str] = []
    padded, packed = (
        shard_model(load_model(ModelConfig(model_path=model_dir), attn_implementation=attn), FSDPConfig(), CPU)
        for attn in (None, packed_attn_implementation())
    )
    # The fused head runs on the packed model's second forward: the tower calls are counted per forward, whichever
    # entry point (the fused head calls the backbone from a method of its own).
    for path, model, opts in (
        ("padded", padded, None),
        ("packed", packed, ForwardOptions(padding_free=True)),
        ("fused", packed, ForwardOptions(padding_free=True, fused=True, chunk_size=5)),
    ):
        lp, grads = _lp_grads(model.train(), mbs[rank], opts)
        mask = mbs[rank]["response_mask"].bool()
        checks = {"lp": (lp[mask], alone[rank][0][mask])}
        for name, grad in grads.items():
            parts = [g[1][name] for g in alone]
            want = sum(p if p is not None else torch.zeros_like(parts[0]) for p in parts) / world  # type: ignore[misc]
            checks[name] = (grad.full_tensor() if grad is not None else None, want)
        for name, (got, want) in checks.items():
            try:
                assert got is not None, "no gradient"
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            except AssertionError as exc:
                failures.append(f"rank {rank} {path} {name}: {str(exc).splitlines()[:2]}")
    vision_none = [n for n, g in alone[1][1].items() if g is None and "visual" in n]
    Path(f"{out}.{rank}").write_text(json.dumps({"failures": failures, "vision_none_alone": len(vision_none)}))
    close_rank()


def test_ranks_with_and_without_media_pair_up(tmp_path: Path) -> None:
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    model_dir = build_tiny_vl_checkpoint(tmp_path / "m", "qwen3_vl")  # deepstack mergers: more root-unit params
    video = tmp_path / "clip.mp4"
    _write_video(video)
    run_ranks(_worker, 2, model_dir, str(video), str(tmp_path / "out"))
    for rank in range(2):
        result: dict[str, Any] = json.loads((tmp_path / f"out.{rank}").read_text())
        assert result["failures"] == []
        assert result["vision_none_alone"] > 0  # the text-only row alone never reaches the vision tower


def test_text_only_forward_is_unchanged_and_reaches_the_tower(tmp_path: Path) -> None:
    """On one process: the hooks leave a text-only row's log-probs as they were and give every vision parameter a
    zero gradient rather than none."""
    from easyrl.config import ModelConfig
    from easyrl.models import load_processor
    from easyrl.models.vl_tower import keep_vision_tower_in_step
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.packing import packed_attn_implementation

    model_dir = build_tiny_vl_checkpoint(tmp_path / "m", "qwen2_5_vl")
    video = tmp_path / "clip.mp4"
    _write_video(video)
    mb = _batch(load_processor(model_dir), video).index([2])
    opts = ForwardOptions(padding_free=True)
    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=packed_attn_implementation()).train()
    ref_lp, ref_grads = _lp_grads(model, mb, opts)
    keep_vision_tower_in_step(model)
    lp, grads = _lp_grads(model, mb, opts)
    assert torch.equal(lp, ref_lp)
    vision = [n for n in grads if "visual" in n]
    assert vision and all(ref_grads[n] is None for n in vision)
    for name, grad in grads.items():
        assert grad is not None, name
        if name in vision:
            assert torch.count_nonzero(grad) == 0, name
        else:
            assert torch.equal(grad, ref_grads[name]), name  # type: ignore[arg-type]


def _calls_worker(rank: int, world: int, model_dir: str, video: str, out: str) -> None:
    """Each case of `CASES` (the rows of each rank) through the sharded model: the tower calls the forward makes, and
    whether the log-probs and gradients are those of the unsharded model (the ranks' average)."""

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.models import load_processor, vision_tower
    from easyrl.workers.model_setup import load_model, shard_model

    init_rank(rank, world)
    whole = _batch(load_processor(model_dir), Path(video))
    unsharded = load_model(ModelConfig(model_path=model_dir)).train()
    model = shard_model(load_model(ModelConfig(model_path=model_dir)), FSDPConfig(), CPU).train()
    calls = [0]
    tower = vision_tower(model)
    assert tower is not None
    tower.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    results = []
    for rows in CASES:
        mbs = [whole.index(r) for r in rows]
        alone = [_lp_grads(unsharded, mb, None) for mb in mbs]
        calls[0] = 0
        lp, grads = _lp_grads(model, mbs[rank], None)
        mask = mbs[rank]["response_mask"].bool()
        failures = [] if torch.allclose(lp[mask], alone[rank][0][mask], atol=2e-5) else ["lp"]
        for name, grad in grads.items():
            full = grad.full_tensor() if grad is not None else None
            parts = [g[1][name] for g in alone]
            # a parameter no rank's row reaches (the vision tower, text on both ranks): a zero gradient, not none
            want = sum(p if p is not None else torch.zeros_like(full) for p in parts) / world  # type: ignore[misc]
            if full is None or not torch.allclose(full, want, atol=2e-5, rtol=1e-4):
                failures.append(name)
        results.append({"failures": failures, "calls": calls[0]})
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    close_rank()


CASES = ([[0], [2]], [[2], [2]])
"""Rows of `_batch` per rank: an image and text; text and text."""


def test_a_media_kind_no_rank_has_costs_no_tower_call(tmp_path: Path) -> None:
    """Images on one rank and text on the other: one tower call per rank (the text rank's dummy), not two (a video
    dummy on both, as before); text on both ranks: no tower call at all, the vision parameters still get their zero
    gradient from each rank's own shard. Gradients stay the ranks' average either way."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    model_dir = build_tiny_vl_checkpoint(tmp_path / "m", "qwen2_5_vl")
    video = tmp_path / "clip.mp4"
    _write_video(video)
    run_ranks(_calls_worker, 2, model_dir, str(video), str(tmp_path / "out"))
    for rank in range(2):
        results: list[dict[str, Any]] = json.loads((tmp_path / f"out.{rank}").read_text())
        assert results == [{"failures": [], "calls": 1}, {"failures": [], "calls": 0}], rank
