"""The memory plan of the published Qwen2.5 shapes (0.5B, 1.5B, 3B, VL-3B) on one 80 GiB GPU, against figures
computed by hand from their config.json (no download: the configs are built here), `easyrl check`'s refusal of
a plan that cannot fit, with the setting that fixes it, and the plans of the 8-GPU recipes for Qwen3-VL-8B,
Qwen3.5-4B and Qwen3-30B-A3B on their published shapes."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from pytest import MonkeyPatch
from transformers import Qwen2_5_VLConfig, Qwen2Config, Qwen3_5Config, Qwen3MoeConfig, Qwen3VLConfig

from easyrl.check import memory_report
from easyrl.config import EasyRLConfig
from easyrl.memory_plan import (
    GiB,
    ModelShape,
    cuda_graph_bytes,
    engine_capture_sizes,
    plan_fixes,
    plan_memory,
    vision_parameter_count,
)


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


def _layer_parameters(h: int, heads: int, inter: int) -> int:
    """One Qwen2.5 decoder layer by hand: head_dim = h / heads, 2 KV heads, q/k/v biases."""
    kv = 2 * (h // heads)
    attention = h * h + 2 * h * kv + h * h + (h + 2 * kv)  # q, k, v, o and the q/k/v biases
    return attention + 3 * h * inter + 2 * h  # SwiGLU MLP, two RMSNorms


def _text_parameters(h: int, layers: int, heads: int, inter: int) -> int:
    """Qwen2.5 text parameters by hand: the layers, the embedding tied with the head, the final norm."""
    return layers * _layer_parameters(h, heads, inter) + 151936 * h + h


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
        # its weight gradient in bf16, written block by block of vocabulary columns (no fp32 (V, H) sum)
        + 151936 * h * 2
        # over the 16 blocks, the hidden states' gradient: its fp32 sum and one block's bf16 product
        + tokens * h * (4 + 2)
    )
    assert plan.actor.activations == activations
    assert plan.ref_weights == 4 * params
    engine = int(0.6 * H100)
    assert plan.engine_weights == 2 * params
    kv_per_token = 2 * layers * 2 * head_dim * 2  # k and v, every layer, 2 KV heads, bf16
    # vLLM's CUDA graphs for the sizes it captures (tests/test_cuda_graph_plan.py pins the estimate)
    graphs = cuda_graph_bytes(_shape(model), engine_capture_sizes(cfg), 2)
    assert plan.cuda_graphs == graphs > 0
    assert plan.kv_cache_tokens == (engine - 2 * params - graphs) // kv_per_token  # less the CUDA graphs
    contexts = 2 * GiB // 2  # actor and reference processes, one CUDA context each, no NCCL on one rank
    assert plan.generating == engine + 4 * params + 8 * params + 4 * params + contexts
    # FSDP2's bf16 gathered copies at the head's backward: the root unit (tied embedding, final norm) and two layers
    gathered = (151936 * h + h + 2 * _layer_parameters(h, text["num_attention_heads"], inter)) * 2
    assert plan.actor.gathered == gathered
    assert plan.updating == 16 * params + activations + gathered + 4 * params + graphs + contexts


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
    (no reference process, no reference weights); without CUDA graphs the KV cache gets their bytes."""
    shape = _shape("1.5b")
    level1 = plan_memory(shape, _config(worker={"rollout": {"sleep_level": 1}}), H100)
    assert level1.pinned_host == 2 * 1_543_714_304
    lora = _config(algorithm={"disable_kl": False}, worker={"actor": {"model": {"lora": {"rank": 8}}}})
    plan = plan_memory(shape, lora, H100)
    assert (plan.ref_weights, plan.processes) == (0, 1)
    eager = plan_memory(shape, _config(worker={"rollout": {"enforce_eager": True}}), H100)
    assert eager.cuda_graphs == 0 and eager.kv_cache == int(0.6 * H100) - 2 * 1_543_714_304


def test_a_lora_role_plans_gradients_and_optimizer_states_for_its_adapters_alone(tiny_model_dir: str) -> None:
    """`lora_parameters` is the adapter count peft makes on a dense model (`all-linear`), and a LoRA actor or critic
    plans gradients and Adam moments for those (plus the critic's value head), not for its frozen base."""
    from transformers import AutoConfig

    from easyrl.config.worker import LoraConfig, ModelConfig
    from easyrl.memory_plan import _sharded, lora_parameters
    from easyrl.workers.lora import apply_lora
    from easyrl.workers.model_setup import load_model

    model = load_model(ModelConfig(model_path=tiny_model_dir))
    made = apply_lora(model, LoraConfig(rank=4))
    assert lora_parameters(ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir)), 4) == made
    shape = _shape("1.5b")
    full = plan_memory(shape, _config(algorithm={"adv_estimator": "gae"}), H100)
    lora = {"model": {"lora": {"rank": 8}}}
    cfg = _config(algorithm={"adv_estimator": "gae"}, worker={"actor": lora, "critic": lora})
    plan = plan_memory(shape, cfg, H100)
    adapters, ranks = lora_parameters(shape, 8), 8  # the default 8 GPUs shard everything
    # fp32 master weights, two fp32 moments
    assert (plan.actor.grads, plan.actor.optimizer) == (_sharded(adapters, 4, ranks), _sharded(adapters, 8, ranks))
    assert plan.critic is not None and plan.critic.grads == _sharded(adapters + shape.hidden_size + 1, 4, ranks)
    assert plan.actor.weights == full.actor.weights and plan.updating < full.updating - 5 * 10**9  # of ~14 GB


# The published config.json fields of the models the 8-GPU recipes train (configs/easyr1), written from what is
# known of them here, not downloaded (no network); Qwen3.5-4B's are the least certain. A field that differs moves
# the figures below, not whether the plan fits by a wide margin.
PUBLISHED = {
    "qwen3_vl_8b": (
        Qwen3VLConfig,
        {
            "text_config": {
                "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
            },
            "vision_config": {
                "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
                "patch_size": 16, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
            },
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_5_4b": (
        Qwen3_5Config,
        {
            "text_config": {
                "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 16,
                "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "vocab_size": 248320, "tie_word_embeddings": True, "max_position_embeddings": 262144,
            },
            "vision_config": {
                "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2560
            },
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_30b_a3b": (
        Qwen3MoeConfig,
        {
            "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
            "max_position_embeddings": 40960,
        },
    ),
}  # fmt: skip

# (recipe, published model, parameters, GiB while generating, GiB while updating) on GPUs of 80 GiB; the first two
# defer their gradient reduction (their unsharded gradients fit: docs/models.md), the 30B one cannot
RECIPE_PLANS = [
    ("geo3k_grpo_qwen3_vl_8b", "qwen3_vl_8b", "8.77B", "53.6", "67.6"),
    ("math_grpo_qwen3_5_4b", "qwen3_5_4b", "4.54B", "51.6", "38.6"),
    ("math_grpo_qwen3_30b_a3b", "qwen3_30b_a3b", "30.53B", "56.6", "48.2"),
]


@pytest.mark.parametrize(("recipe", "model", "params", "generating", "updating"), RECIPE_PLANS, ids=lambda v: v)
def test_recipe_fits_eight_80_gib_gpus(
    recipe: str, model: str, params: str, generating: str, updating: str, tmp_path: Path, monkeypatch: MonkeyPatch
) -> None:
    """`easyrl check RECIPE --gpu-memory 80` with the model folder holding only the published config.json (no
    weights, no tokenizer: the plan reads the config alone) prints the plan and finds no problem; the figures are
    the ones docs/models.md quotes."""
    from easyrl.check import print_memory_plan
    from easyrl.config import load_config
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    config_cls, fields = PUBLISHED[model]
    config_cls(**fields).save_pretrained(tmp_path / model)  # writes config.json only
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    overrides = [
        f"worker.actor.model.model_path={tmp_path / model}",
        f"data.train_files={data}",
        f"data.val_files={data}",
    ]
    cfg = load_config(REPO / "configs" / "easyr1" / f"{recipe}.yaml", overrides)
    assert cfg.trainer.n_gpus_per_node == 8
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = print_memory_plan(cfg, gpu_memory_gib=80)
    text = out.getvalue()
    assert code == 0 and "easyrl: memory error" not in text, text
    assert f"model: {params} parameters; device: 80.0 GiB" in text, text
    assert f"while generating: {generating} of 80.0 GiB" in text and f"while updating: {updating} of 80.0" in text


def test_gpu_memory_flag_takes_a_positive_size_and_rl_configs_only(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    from easyrl.cli import main
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    published = tmp_path / "model"
    Qwen3MoeConfig(**PUBLISHED["qwen3_30b_a3b"][1]).save_pretrained(published)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    args = ["check", "configs/easyr1/math_grpo_qwen3_30b_a3b.yaml", f"worker.actor.model.model_path={published}",
            f"data.train_files={data}", f"data.val_files={data}", "--gpu-memory", "0"]  # fmt: skip
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(args) == 2
    assert "easyrl: --gpu-memory must be a positive GiB count (80 for an H100), got 0" in err.getvalue()
