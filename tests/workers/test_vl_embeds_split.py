"""The vision tower's frames split over a sequence-parallel group (`easyrl.models.vl_embeds`) equals one rank encoding
everything: log-probs, entropy, loss and every FSDP2 gradient, the tower's included, on 2 gloo ranks (Ulysses 2),
for tiny Qwen2.5-VL (trained and frozen tower) and Qwen3-VL (deepstack, fused head); each rank's tower sees only its
share of the patches, and each distinct item is encoded once though every row appears twice."""

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


def _case(model_dir: str, video: str, fused: bool, frozen: bool) -> tuple[dict[str, Any], list[int], int]:
    """(split, unsplit) pairs of everything compared; the patch rows this rank's tower encoded; the unsplit ones."""
    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.models import load_processor, vision_tower
    from easyrl.models.embed_cache import tower_version
    from easyrl.models.vl_embeds import install_embed_reuse
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    base = _batch(load_processor(model_dir), Path(video))
    mb = Batch.concat([base, base])  # every media item twice, as the n samples of a prompt
    cfg = ModelConfig(model_path=model_dir, freeze_vision_tower=frozen)
    varlen = register_varlen_attention()
    ref_model = load_model(cfg, attn_implementation=varlen).train()
    whole_rows: list[int] = []
    vision_tower(ref_model).register_forward_pre_hook(lambda m, a: whole_rows.append(a[0].shape[0]))
    ref_lp, ref_ent, ref_loss = _loss(ref_model, mb, ForwardOptions(padding_free=True, fused=fused, chunk_size=5))
    ref_loss.backward()
    attn = enable_sequence_parallel(SP, varlen)
    split_model = load_model(cfg, attn_implementation=attn.attn_implementation)
    attn.attach(split_model)
    tower = vision_tower(split_model)
    install_embed_reuse(split_model, tower_version(tower) if frozen else None)
    rows: list[int] = []
    tower.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    model = shard_model(split_model, FSDPConfig(), CPU)
    opts = ForwardOptions(padding_free=True, fused=fused, chunk_size=5, ulysses_size=SP)
    lp, ent, loss = _loss(model.train(), mb, opts)
    loss.backward()
    mask = mb["response_mask"].bool()
    ref_grads = dict(ref_model.named_parameters())
    checks = {"lp": (lp[mask], ref_lp[mask]), "ent": (ent[mask], ref_ent[mask]), "loss": (loss, ref_loss)}
    checks |= {n: (p.grad.full_tensor(), ref_grads[n].grad) for n, p in model.named_parameters() if p.grad is not None}
    return checks, rows, sum(whole_rows)


def _worker(rank: int, world: int, cases: list[tuple[str, bool, bool]], video: str, out: str) -> None:

    init_rank(rank, world)
    failures: list[str] = []
    compared, rows = 0, []
    for model_dir, fused, frozen in cases:
        checks, mine, whole = _case(model_dir, video, fused, frozen)
        rows.append((sum(mine), whole))
        for name, (got, want) in checks.items():
            compared += 1
            try:
                torch.testing.assert_close(got.detach(), want.detach(), atol=2e-5, rtol=1e-4)
            except AssertionError as exc:
                failures.append(f"{Path(model_dir).name} frozen={frozen} {name}: {str(exc).splitlines()[:3]}")
    Path(f"{out}.{rank}").write_text(json.dumps({"failures": failures, "compared": compared, "rows": rows}))
    close_rank()


def test_split_tower_equals_one_rank(tmp_path: Path) -> None:
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    qwen25, qwen3 = (build_tiny_vl_checkpoint(tmp_path / a, a) for a in ("qwen2_5_vl", "qwen3_vl"))
    video = tmp_path / "clip.mp4"
    _write_video(video)
    out = tmp_path / "result.json"
    cases = [(qwen25, False, False), (qwen25, False, True), (qwen3, True, False)]
    run_ranks(_worker, SP, cases, str(video), str(out))
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(SP)]
    for result in results:
        assert result["failures"] == []
        assert result["compared"] > 50  # log-probs, entropy, loss and every trained parameter's gradient
    for case in range(len(cases)):
        mine = [r["rows"][case][0] for r in results]
        whole = results[0]["rows"][case][1]
        # the unsplit model encodes every row's media (each item twice); the group encodes each item once, shared
        assert sum(mine) * 2 == whole, (mine, whole)
        assert all(0 < m < sum(mine) for m in mine)
