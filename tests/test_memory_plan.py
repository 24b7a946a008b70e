"""The memory plan of the published Qwen2.5 shapes (0.5B, 1.5B, 3B, VL-3B) on one 80 GiB GPU, against figures
computed by hand from their config.json (no download: the configs are built here), and `easyrl check`'s refusal of
a plan that cannot fit, with the setting that fixes it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from transformers import Qwen2_5_VLConfig, Qwen2Config

from easyrl.check import memory_report
from easyrl.config import EasyRLConfig
from easyrl.memory_plan import GiB, ModelShape, plan_fixes, plan_memory, vision_parameter_count


H100 = 80 * GiB
"""The device total the plans below are made for (an H100 80GB reports ~79.2 GiB; round figures read better)."""

# Published config.json of each model, the fields the plan reads.
QWEN25 = {
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "intermediate_size": 4864},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "intermediate_size": 8960},
    "3b": {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "intermediate_size": 11008},
}
VL_3B_VISION = {  # Qwen2.5-VL-3B-Instruct's vision_config
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}


def _text(size: str) -> dict[str, object]:
    # every Qwen2.5 size below 7B: vocabulary 151936, 2 KV heads, tied embeddings
    return {**QWEN25[size], "vocab_size": 151936, "num_key_value_heads": 2, "tie_word_embeddings": True}


def _shape(model: str) -> ModelShape:
    if model == "vl-3b":
        config = Qwen2_5_VLConfig(text_config=_text("3b"), vision_config=VL_3B_VISION, tie_word_embeddings=True)
        return ModelShape.from_hf_config(config)
    return ModelShape.from_hf_config(Qwen2Config(**_text(model)))


def _config(**sections: object) -> EasyRLConfig:
    base = OmegaConf.structured(EasyRLConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create(sections)))  # type: ignore[return-value]


def test_vision_tower_of_qwen25_vl_3b_by_hand() -> None:
    """Qwen2.5-VL-3B is 3.75B parameters: 3.09B of text and a 0.67B vision tower."""
    patch_embed = 3 * 2 * 14 * 14 * 1280  # Conv3d, channels x temporal patch x patch x patch -> 1280, no bias
    block = (
        2 * 1280  # two RMSNorms
        + 1280 * 3 * 1280
        + 3 * 1280  # fused qkv with bias
        + 1280 * 1280
        + 1280  # attention output projection
        + 2 * (1280 * 3420 + 3420)  # gate and up projections with bias
        + 3420 * 1280
        + 1280  # down projection
    )
    merger = 1280 + (4 * 1280) ** 2 + 4 * 1280 + 4 * 1280 * 2048 + 2048  # RMSNorm, 2x2-merged MLP -> text width
    vision = patch_embed + 32 * block + merger
    assert vision == 668_684_288
    config = Qwen2_5_VLConfig(text_config=_text("3b"), vision_config=VL_3B_VISION, tie_word_embeddings=True)
    assert vision_parameter_count(config) == vision  # counted on a model built on the meta device
    assert vision_parameter_count(Qwen2Config(**_text("3b"))) == 0
    assert _shape("vl-3b").parameter_count() == 3_085_938_688 + vision == 3_754_622_976


def _text_parameters(h: int, layers: int, heads: int, inter: int) -> int:
    """Qwen2.5 text parameters by hand: head_dim = h / heads, 2 KV heads, q/k/v biases, tied head."""
    kv = 2 * (h // heads)
    attention = h * h + 2 * h * kv + h * h + (h + 2 * kv)  # q, k, v, o and the q/k/v biases
    layer = attention + 3 * h * inter + 2 * h  # SwiGLU MLP, two RMSNorms
    return layers * layer + 151936 * h + h  # embedding (tied with the head), final norm


# (model, parameters by hand, head_dim = hidden / heads)
MODELS = [
    ("0.5b", _text_parameters(896, 24, 14, 4864), 64),
    ("1.5b", _text_parameters(1536, 28, 12, 8960), 128),
    ("3b", _text_parameters(2048, 36, 16, 11008), 128),
    ("vl-3b", _text_parameters(2048, 36, 16, 11008) + 668_684_288, 128),
]


@pytest.mark.parametrize(("model", "params", "head_dim"), MODELS, ids=[m[0] for m in MODELS])
def test_plan_of_the_published_shapes_on_one_gpu(model: str, params: int, head_dim: int) -> None:
    """Defaults (fp32 master weights and AdamW, dynamic batching at 16384 tokens, gradient checkpointing, fused head,
    vLLM in bf16 at 0.6 of the device, CUDA graphs), one GPU, with a reference model."""
    assert params == {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688}.get(model, 3_754_622_976)
    cfg = _config(trainer={"n_gpus_per_node": 1}, algorithm={"disable_kl": False})
    plan = plan_memory(_shape(model), cfg, H100)
    text = QWEN25["3b" if model == "vl-3b" else model]
    h, layers, inter = text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]
    assert isinstance(h, int) and isinstance(layers, int) and isinstance(inter, int)
    assert plan.parameters == params
    assert (plan.actor.weights, plan.actor.grads, plan.actor.optimizer) == (4 * params, 4 * params, 8 * params)
    tokens = 16384
    activations = (
        layers * tokens * h * 2  # each checkpointed layer's bf16 input
        # one layer's working set: norms/attention output/residual (3h), q and its output (2h), k and v (2 x 2 KV
        # heads), the MLP's gate, up and product (3 x intermediate), in bf16
        + tokens * (3 * h + 2 * h + 2 * 2 * head_dim + 3 * inter) * 2
        + 1024 * 151936 * 8  # the fused head's chunk: fp32 log-softmax and its gradient
    )
    assert plan.actor.activations == activations
    assert plan.ref_weights == 4 * params
    engine = int(0.6 * H100)
    assert plan.engine_weights == 2 * params
    kv_per_token = 2 * layers * 2 * head_dim * 2  # k and v, every layer, 2 KV heads, bf16
    assert plan.kv_cache_tokens == (engine - 2 * params - GiB) // kv_per_token  # less the 1 GiB of CUDA graphs
    contexts = 2 * GiB // 2  # actor and reference processes, one CUDA context each, no NCCL on one rank
    assert plan.generating == engine + 4 * params + 8 * params + 4 * params + contexts
    assert plan.updating == 16 * params + activations + 4 * params + GiB + contexts


def test_bench_vl_3b_old_setting_is_refused_with_its_arithmetic() -> None:
    """scripts/bench_vl.py used to train VL-3B with fp32 AdamW and an fp32 reference at utilization 0.4: generating
    needs 0.4 x 80 + 16 x 3.75B bytes (fp32 weights, two fp32 moments, fp32 reference) + 2 contexts = 88.9 GiB.
    `check` says so and names what fits: adamw_bf16 (bench_vl's default now), offload, or utilization 0.28."""
    shape = _shape("vl-3b")
    old = _config(trainer={"n_gpus_per_node": 1}, algorithm={"disable_kl": False}, worker={
        "rollout": {"gpu_memory_utilization": 0.4}})  # fmt: skip
    generating = int(0.4 * H100) + 16 * 3_754_622_976 + GiB
    assert plan_memory(shape, old, H100).generating == generating
    assert f"{generating / GiB:.1f}" == "88.9"
    _, problems = memory_report(shape, old, H100)
    assert problems[0].startswith("generating needs 88.9 of 80.0 GiB (engine 32.0 + actor weights 14.0 + optimizer")
    fixes = [p for p in problems if p.startswith("fits with ")]
    assert [f.split(":")[0] for f in fixes] == [
        "fits with worker.actor.optim.strategy=adamw_bf16",
        "fits with worker.actor.offload.offload_params=true worker.actor.offload.offload_optimizer=true",
        "fits with worker.rollout.gpu_memory_utilization=0.28",
    ]
    # 0.28 is the largest hundredth that fits: room = 80 - (88.9 - 32) GiB = 23.05 GiB = 0.288 of the device
    for utilization, fits in ((0.28, True), (0.29, False)):
        trial = _config(trainer={"n_gpus_per_node": 1}, algorithm={"disable_kl": False}, worker={
            "rollout": {"gpu_memory_utilization": utilization}})  # fmt: skip
        assert plan_memory(shape, trial, H100).fits is fits
    new = _config(trainer={"n_gpus_per_node": 1}, algorithm={"disable_kl": False}, worker={
        "rollout": {"gpu_memory_utilization": 0.4}, "actor": {"optim": {"strategy": "adamw_bf16"}},
        "ref": {"fsdp": {"torch_dtype": "bf16"}}})  # fmt: skip
    assert memory_report(shape, new, H100)[1] == []
    # 0.4 x 80 + fp32 weights (4) + two bf16 moments (4) + bf16 reference (2) = 10 bytes a parameter, + 2 contexts
    assert plan_memory(shape, new, H100).generating == int(0.4 * H100) + 10 * 3_754_622_976 + GiB
    assert plan_fixes(shape, new, H100) == []


def test_level_one_sleep_pins_the_engine_weights_and_lora_serves_the_reference() -> None:
    """Sleep level 1 keeps a copy of the engine's weights in pinned host memory; a LoRA actor is its own reference
    (no reference process, no reference weights); without CUDA graphs the KV cache gets their GiB."""
    shape = _shape("1.5b")
    level1 = plan_memory(shape, _config(worker={"rollout": {"sleep_level": 1}}), H100)
    assert level1.pinned_host == 2 * 1_543_714_304
    lora = _config(algorithm={"disable_kl": False}, worker={"actor": {"model": {"lora": {"rank": 8}}}})
    plan = plan_memory(shape, lora, H100)
    assert (plan.ref_weights, plan.processes) == (0, 1)
    eager = plan_memory(shape, _config(worker={"rollout": {"enforce_eager": True}}), H100)
    assert eager.cuda_graphs == 0 and eager.kv_cache == int(0.6 * H100) - 2 * 1_543_714_304
