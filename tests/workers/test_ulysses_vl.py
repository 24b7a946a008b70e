"""Ulysses sequence parallelism on vision-language rows equals no split: log-probs, entropy, loss and FSDP2 gradients
(vision tower included) with ulysses_size 2 on 2 gloo ranks, for tiny Qwen2.5-VL (plain head, and the critic's values)
and Qwen3-VL (fused head, deepstack), on a micro-batch with images, a video and a text-only row; and for the tiny
Omni thinkers (Qwen2.5-Omni with Ulysses and the fused head, Qwen3-Omni MoE with ring attention and its critic's
values: audio and vision towers included) on rows with clips, an image and a text-only row."""

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


def _micro_batch(model_dir: str, video: str) -> Batch:
    """The VL rows (images, a video, text), or an Omni thinker's (clips, an image, text; written beside `video`)."""
    from easyrl.models import load_processor
    from easyrl.models.family import family_of
    from tests.models.omni_checks import omni_batch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if family_of(str(config["model_type"])).thinker:
        folder = Path(video).parent / f"{Path(model_dir).name}_rows"
        folder.mkdir(exist_ok=True)
        mb = omni_batch(model_dir, folder)
        return mb.set(advantages=torch.randn(mb["responses"].shape, generator=torch.Generator().manual_seed(0)))
    return _batch(load_processor(model_dir), Path(video))


def _case(model_dir: str, video: str, fused: bool, ring: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(split, unsplit) pairs of everything compared, for one model; this rank's view. `ring`: split by ring
    attention (ring_size 2) instead of Ulysses."""
    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    mb = _micro_batch(model_dir, video)
    varlen = register_varlen_attention()
    ref_model = load_model(ModelConfig(model_path=model_dir), attn_implementation=varlen).train()
    ref_lp, ref_ent, ref_loss = _loss(ref_model, mb, ForwardOptions(padding_free=True, fused=fused, chunk_size=5))
    ref_loss.backward()
    layout = {"ulysses_size": 1, "ring_size": SP} if ring else {"ulysses_size": SP}
    attn = enable_sequence_parallel(layout["ulysses_size"], varlen, layout.get("ring_size", 1))
    split_model = load_model(ModelConfig(model_path=model_dir), attn_implementation=attn.attn_implementation)
    attn.attach(split_model)
    model = shard_model(split_model, FSDPConfig(), CPU)
    opts = ForwardOptions(padding_free=True, fused=fused, chunk_size=5, **layout)
    lp, ent, loss = _loss(model.train(), mb, opts)
    loss.backward()
    mask = mb["response_mask"].bool()
    ref_grads = dict(ref_model.named_parameters())
    checks = {"lp": (lp[mask], ref_lp[mask]), "ent": (ent[mask], ref_ent[mask]), "loss": (loss, ref_loss)}
    params = list(model.named_parameters())
    # the same parameters get gradients (an Omni thinker's `audio_bos_eos` gets none in either), and the same ones
    checks["has_grad"] = (
        torch.tensor([p.grad is not None for _, p in params]),
        torch.tensor([ref_grads[n].grad is not None for n, _ in params]),
    )
    checks |= {n: (p.grad.full_tensor(), ref_grads[n].grad) for n, p in params if p.grad is not None}
    if not fused:
        checks["values"] = (
            _values(model_dir, mb, ForwardOptions(padding_free=True, **layout), attn),
            _values(model_dir, mb, ForwardOptions(padding_free=True), varlen),
        )
    return checks


def _worker(rank: int, world: int, cases: list[tuple[str, bool, bool]], video: str, out: str) -> None:

    init_rank(rank, world)
    failures: list[str] = []
    compared = 0
    for model_dir, fused, ring in cases:
        for name, (got, want) in _case(model_dir, video, fused, ring).items():
            compared += 1
            try:
                torch.testing.assert_close(got.detach(), want.detach(), atol=2e-5, rtol=1e-4)
            except AssertionError as exc:
                failures.append(
                    f"{Path(model_dir).name} fused={fused} ring={ring} {name}: {str(exc).splitlines()[:3]}"
                )
    if rank == 0:
        Path(out).write_text(json.dumps({"failures": failures, "compared": compared}))
    close_rank()


def test_ulysses_vl_and_omni_equal_unsplit(tmp_path: Path) -> None:
    from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    # Qwen3-VL MoE (fused head): its deepstack rows and routed experts behind the same seam
    qwen25, qwen3, moe = (
        build_tiny_vl_checkpoint(tmp_path / a, a) for a in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    )
    # Qwen2.5-Omni through the fused head (its own forward, an identity head); Qwen3-Omni MoE unfused, with its critic's
    # values, split by ring attention behind the same seam
    omni, omni_moe = (build_tiny_omni_checkpoint(tmp_path / v, variant=v) for v in ("qwen2_5_omni", "qwen3_omni_moe"))
    video = tmp_path / "clip.mp4"
    _write_video(video)
    out = tmp_path / "result.json"
    cases = [
        (qwen25, False, False),
        (qwen3, True, False),
        (moe, True, False),
        (omni, True, False),
        (omni_moe, False, True),
    ]
    run_ranks(_worker, SP, cases, str(video), str(out))
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["failures"] == []
    assert result["compared"] > 200  # log-probs, entropy, loss, values and every parameter's gradient
