"""Ulysses sequence parallelism equals no split: log-probs, entropy, loss and FSDP2 gradients on 4 gloo ranks, for
tiny Qwen2 and Qwen3 (4 query heads, 2 KV heads: ulysses_size 4 repeats the KV heads), split 2 ways (two
data-parallel groups of 2) and 4 ways; values of a critic too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing import make_batch


CPU = torch.device("cpu")
WORLD = 4


def _loss(model: torch.nn.Module, mb: Batch, opts: ForwardOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from easyrl.workers.forward_backward import token_log_probs

    lp, ent = token_log_probs(model, mb, CPU, 0.9, with_entropy=True, opts=opts)
    assert ent is not None
    mask = mb["response_mask"].float()
    loss = -(lp * mb["advantages"] * mask).sum() / mask.sum() - 0.1 * (ent * mask).sum() / mask.sum()
    return lp, ent, loss


def _reference(model_dir: str, batches: list[Batch], fused: bool) -> dict[str, Any]:
    """Unsplit, unsharded: each group's log-probs, entropy and loss, and the gradient averaged over the groups (what
    FSDP2's averaging gives)."""
    from easyrl.config import ModelConfig
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.varlen import register_varlen_attention

    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=register_varlen_attention()).train()
    opts = ForwardOptions(padding_free=True, fused=fused, chunk_size=5)
    out: dict[str, Any] = {"lp": [], "ent": [], "loss": []}
    for mb in batches:
        lp, ent, loss = _loss(model, mb, opts)
        (loss / len(batches)).backward()
        out["lp"].append(lp.detach())
        out["ent"].append(ent.detach())
        out["loss"].append(float(loss))
    out["grads"] = {n: p.grad for n, p in model.named_parameters()}
    return out


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
    model = shard_model(model, FSDPConfig(), CPU)
    return response_values(model, mb, CPU, opts).detach()


def _worker(rank: int, world: int, cases: list[tuple[str, int, bool]], out: str) -> None:

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.model_setup import load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    init_rank(rank, world)
    failures: list[str] = []
    for model_dir, sp, fused in cases:
        groups = world // sp
        batches = [make_batch(b=3, p=9, r=7, vocab=90, seed=10 * sp + g) for g in range(groups)]
        ref = _reference(model_dir, batches, fused)
        attn = enable_sequence_parallel(sp, register_varlen_attention())
        model = load_model(ModelConfig(model_path=model_dir), attn_implementation=attn.attn_implementation)
        attn.attach(model)
        # checkpointing (one case): the backward runs the layers' forwards again, the all-to-alls included
        model = shard_model(model, FSDPConfig(), CPU, gradient_checkpointing=fused)
        opts = ForwardOptions(padding_free=True, fused=fused, chunk_size=5, ulysses_size=sp)
        group = rank // sp
        lp, ent, loss = _loss(model.train(), batches[group], opts)
        loss.backward()
        mask = batches[group]["response_mask"].bool()
        checks = {
            "lp": (lp[mask], ref["lp"][group][mask]),
            "ent": (ent[mask], ref["ent"][group][mask]),
            "loss": (loss, torch.tensor(ref["loss"][group])),
        }
        checks |= {n: (p.grad.full_tensor(), ref["grads"][n]) for n, p in model.named_parameters()}
        if not fused:  # the critic's forward (no fused head)
            checks["values"] = (
                _values(model_dir, batches[group], ForwardOptions(padding_free=True, ulysses_size=sp), attn),
                _values(model_dir, batches[group], ForwardOptions(padding_free=True), register_varlen_attention()),
            )
        for name, (got, want) in checks.items():
            try:
                torch.testing.assert_close(got.detach(), want.detach(), atol=2e-5, rtol=1e-4)
            except AssertionError as exc:
                failures.append(f"{Path(model_dir).name} sp={sp} fused={fused} {name}: {str(exc).splitlines()[:3]}")
    if rank == 0:
        Path(out).write_text(json.dumps(failures))
    close_rank()


def test_ulysses_equals_unsplit(tmp_path: Path) -> None:
    """One 4-rank run (the process start is the cost): Qwen2 split 2 ways (2 data-parallel groups), plain head,
    with the critic's values; Qwen3 split 4 ways (KV heads repeated), fused head, gradient checkpointing; Qwen3 MoE
    split 2 ways, fused head (its routed experts FSDP2-sharded one per rank, the router's gradient compared too)."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    qwen2, qwen3, moe = (
        build_tiny_checkpoint(tmp_path / a, arch=a, num_heads=4, num_kv_heads=2)
        for a in ("qwen2", "qwen3", "qwen3_moe")
    )
    out = tmp_path / "failures.json"
    run_ranks(_worker, WORLD, [(qwen2, 2, False), (qwen3, 4, True), (moe, 2, True)], str(out))
    assert json.loads(out.read_text()) == []


def test_shard_sequence_pads_with_a_sequence_of_its_own() -> None:
    from easyrl.distributed.sequence_parallel import SPGroup, shard_sequence

    ids, pos = torch.arange(10, 15)[None], torch.tensor([[0, 1, 2, 0, 1]])
    mrope = torch.stack([pos, pos + 1, pos + 2])  # (3, 1, T)
    for rank, want_pos in ((0, [0, 1, 2]), (1, [0, 1, 0])):
        local, full = shard_sequence(
            SPGroup(None, 2, rank),
            {"input_ids": (ids, 1), "position_ids": (pos, 1), "mrope": (mrope, 2)},
            position_keys=("position_ids", "mrope"),
        )
        assert local["position_ids"].tolist() == [want_pos]
        assert local["mrope"].shape == (3, 1, 3)
    assert full["input_ids"].tolist() == [[10, 11, 12, 13, 14, 0]]
    assert full["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
