"""Each newer model family end to end on CPU (docs/models.md): one GRPO step on 2 FSDP2 workers with packed rows and
the fused head, a resumed second step, and the merge of its checkpoint into a folder transformers loads back with
the trained weights. Tiny random models: Qwen3 MoE (text), Qwen3-VL MoE, Qwen3.5 and Qwen3.5 MoE (with images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easyrl.merge import main as merge_main
from easyrl.models import model_class_for
from easyrl.testing.tiny import build_tiny_checkpoint
from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
from tests.trainer.test_e2e import assert_finite, ray_session, run  # noqa: F401  (module-scoped Ray fixture)
from tests.trainer.test_vl_e2e import _image_data, vl_edits


pytestmark = pytest.mark.slow

FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# The parameters each family is about: routed experts and their router, the Gated DeltaNet layers
_FEATURES = {
    "qwen3_moe": ("mlp.experts.", "mlp.gate."),
    "qwen3_vl_moe": ("mlp.experts.", "mlp.gate.", "visual."),
    "qwen3_5": ("linear_attn.", "self_attn.", "visual."),
    "qwen3_5_moe": ("linear_attn.", "mlp.experts.", "mlp.shared_expert.", "visual."),
}
PACKED = {
    # the paths the traps live on: padding-free packed rows, the fused head, token-budget micro-batches
    "worker.actor.padding_free": True,
    "worker.actor.fused_logprobs": True,
    "worker.actor.dynamic_batching": True,
    "trainer.save_freq": 1,
}


def _model(folder: Path, family: str) -> str:
    if family == "qwen3_moe":  # 2 query heads and 1 key/value head of 32: vLLM's CPU attention takes that size
        return build_tiny_checkpoint(folder, family, num_heads=2, num_kv_heads=1)
    return build_tiny_vl_checkpoint(folder, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_resume_and_merge(tmp_path: Path, digits_data: dict[str, str], family: str) -> None:
    model = _model(tmp_path / "model", family)
    data, edits = digits_data, dict(PACKED)
    if family != "qwen3_moe":
        images = _image_data(tmp_path / "data")
        data, edits = {"train": images["train"]}, edits | vl_edits(images)
    rows, before, after = run(tmp_path / "run", model, data, edits, steps=1, weights=True)
    assert_finite(rows)
    assert before is not None and after is not None
    for feature in _FEATURES[family]:
        names = [n for n in before if feature in n]
        assert names, f"no {feature} parameters in {family}"
        assert any(not torch.equal(before[n], after[n]) for n in names), f"{feature} got no gradient"
    # The same folder and a longer run: it resumes from global_step_1 and trains step 2.
    rows, _, resumed = run(tmp_path / "run", model, data, edits, steps=2, weights=True)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    assert resumed is not None
    merged = tmp_path / "merged"
    step = tmp_path / "run" / "run" / "global_step_2"
    assert merge_main([str(step), "--output", str(merged), "--dtype", "fp32"]) == 0
    from transformers import AutoConfig

    loaded = model_class_for(AutoConfig.from_pretrained(merged)).from_pretrained(merged, dtype=torch.float32)
    state = dict(loaded.named_parameters(remove_duplicate=False))
    assert state.keys() == resumed.keys()
    for name, param in state.items():
        assert torch.equal(param.detach(), resumed[name]), name
