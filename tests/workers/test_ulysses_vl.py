"""Ulysses sequence parallelism on vision-language rows equals no split: log-probs, entropy, loss and FSDP2 gradients
(vision tower included) with ulysses_size 2 on 2 gloo ranks, for tiny Qwen2.5-VL (plain head, and the critic's values)
and Qwen3-VL (fused head, deepstack), on a micro-batch with images, a video and a text-only row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing_vl import _batch, _write_video
from tests.workers.test_ulysses import CPU, _loss


SP = 2


def _values(model_dir: str, mb: Batch, opts: ForwardOptions, attn: Any) -> torch.Tensor:
    """`attn`: an attention name, or a `SequenceParallel` (its attention, and attached to the model)."""
    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.forward_backward import response_values
    from easyrl.workers.model_setup import load_model, shard_model

    torch.manual_seed(0)  # the value head is fresh: the same init on every rank and in both runs
    impl = attn if isinstance(attn, str) else attn.attn_implementation
    model = load_model(ModelConfig(model_path=model_dir), "value", attn_implementation=impl)
    if not isinstance(attn, str):
        attn.attach(model)
    return response_values(shard_model(model, FSDPConfig(), CPU), mb, CPU, opts).detach()


def _case(model_dir: str, video: str, fused: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(split, unsplit) pairs of everything compared, for one model; this rank's view."""
    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.models import load_processor
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    mb = _batch(load_processor(model_dir), Path(video))
    varlen = register_varlen_attention()
    ref_model = load_model(ModelConfig(model_path=model_dir), attn_implementation=varlen).train()
    ref_lp, ref_ent, ref_loss = _loss(ref_model, mb, ForwardOptions(padding_free=True, fused=fused, chunk_size=5))
    ref_loss.backward()
    attn = enable_sequence_parallel(SP, varlen)
    split_model = load_model(ModelConfig(model_path=model_dir), attn_implementation=attn.attn_implementation)
    attn.attach(split_model)
    model = shard_model(split_model, FSDPConfig(), CPU)
    opts = ForwardOptions(padding_free=True, fused=fused, chunk_size=5, ulysses_size=SP)
    lp, ent, loss = _loss(model.train(), mb, opts)
    loss.backward()
    mask = mb["response_mask"].bool()
    ref_grads = dict(ref_model.named_parameters())
    checks = {"lp": (lp[mask], ref_lp[mask]), "ent": (ent[mask], ref_ent[mask]), "loss": (loss, ref_loss)}
    checks |= {n: (p.grad.full_tensor(), ref_grads[n].grad) for n, p in model.named_parameters()}
    if not fused:
        checks["values"] = (
            _values(model_dir, mb, ForwardOptions(padding_free=True, ulysses_size=SP), attn),
            _values(model_dir, mb, ForwardOptions(padding_free=True), varlen),
        )
    return checks


def _worker(rank: int, world: int, cases: list[tuple[str, bool]], video: str, out: str) -> None:

    init_rank(rank, world)
    failures: list[str] = []
    compared = 0
    for model_dir, fused in cases:
        for name, (got, want) in _case(model_dir, video, fused).items():
            compared += 1
            try:
                torch.testing.assert_close(got.detach(), want.detach(), atol=2e-5, rtol=1e-4)
            except AssertionError as exc:
                failures.append(f"{Path(model_dir).name} fused={fused} {name}: {str(exc).splitlines()[:3]}")
    if rank == 0:
        Path(out).write_text(json.dumps({"failures": failures, "compared": compared}))
    close_rank()


def test_ulysses_vl_equals_unsplit(tmp_path: Path) -> None:
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    # Qwen3-VL MoE (fused head): its deepstack rows and routed experts behind the same seam
    qwen25, qwen3, moe = (
        build_tiny_vl_checkpoint(tmp_path / a, a) for a in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    )
    video = tmp_path / "clip.mp4"
    _write_video(video)
    out = tmp_path / "result.json"
    run_ranks(_worker, SP, [(qwen25, False), (qwen3, True), (moe, True)], str(video), str(out))
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["failures"] == []
    assert result["compared"] > 100  # log-probs, entropy, loss, values and every parameter's gradient
