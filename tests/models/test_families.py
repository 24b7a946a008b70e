"""The newer model families through easyrl's model-side paths, in this process (docs/models.md): the tiny builders,
the processor, LoRA's targets and merged stream, the weights sent to an engine in the checkpoint's layout, and the
memory plan's parameter count, the packed layout against the padded one. Tiny random Qwen3 and Qwen3 MoE (text),
Qwen2.5-VL, Qwen3-VL, Qwen3-VL MoE, Qwen3.5 and Qwen3.5 MoE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from easyrl.config import ModelConfig
from easyrl.memory_plan import ModelShape
from easyrl.models import load_processor, model_class_for, vision_spec
from easyrl.models.weight_layout import checkpoint_layout
from easyrl.testing.tiny import build_tiny_checkpoint
from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
from easyrl.workers.lora import lora_layers, merged_weights
from easyrl.workers.model_setup import load_model


FAMILIES = ("qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
TEXT = ("qwen3", "qwen3_moe")
ATTENTION = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
# What LoRA's `all-linear` adapts in layer 0 of each (routed experts and routers are left alone: default_exclude)
ADAPTED = {
    "qwen3": ATTENTION | MLP,
    "qwen2_5_vl": ATTENTION | MLP,
    "qwen3_vl": ATTENTION | MLP,
    "qwen3_moe": ATTENTION,
    "qwen3_vl_moe": ATTENTION,
    "qwen3_5": {f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")} | MLP,
    "qwen3_5_moe": {f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")}
    | {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"},
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp(request.param) / "model"
    if request.param in TEXT:
        return request.param, build_tiny_checkpoint(folder, request.param, num_heads=2, num_kv_heads=1)
    return request.param, build_tiny_vl_checkpoint(folder, request.param)


def _text(config: Any) -> Any:
    return config.get_text_config()


def test_tiny_model_has_the_familys_parts(family: tuple[str, str]) -> None:
    name, path = family
    config = AutoConfig.from_pretrained(path)
    text = _text(config)
    assert (text.hidden_size, text.num_hidden_layers) == (64, 2)
    model = model_class_for(config).from_pretrained(path)
    names = [n for n, _ in model.named_parameters()]
    if "moe" in name:  # 4 routed experts, 2 per token, narrower than the hidden size (no square expert matrix)
        assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        if name in ("qwen3_moe", "qwen3_vl_moe"):  # vLLM 0.26 reads it; Qwen3-VL's config class does not declare it
            assert text.norm_topk_prob is True, "vLLM must renormalise the top-k weights as transformers does"
    if name.startswith("qwen3_5"):  # the hybrid: a Gated DeltaNet layer, then a full-attention one
        assert text.layer_types == ["linear_attention", "full_attention"]
        assert any(".linear_attn." in n for n in names) and any(".self_attn." in n for n in names)
    if name not in TEXT:  # Qwen3-VL's processor (timestamps before video frames) from Qwen3-VL on
        assert vision_spec(load_processor(path)).family == ("qwen2_5_vl" if name == "qwen2_5_vl" else "qwen3_vl")


def test_processor_class_from_the_model_type_alone(family: tuple[str, str], tmp_path: Path) -> None:
    """A folder that names no processor class (older exports) still loads: the model type says which."""
    name, path = family
    if name in TEXT:
        pytest.skip("a text model has no processor")
    bare = Path(shutil.copytree(path, tmp_path / "bare"))
    (bare / "processor_config.json").unlink()
    for file in ("preprocessor_config.json", "tokenizer_config.json", "video_preprocessor_config.json"):
        data = json.loads((bare / file).read_text())
        data.pop("processor_class", None)
        (bare / file).write_text(json.dumps(data))
    expected = "Qwen2_5_VLProcessor" if name == "qwen2_5_vl" else "Qwen3VLProcessor"
    assert type(load_processor(bare)).__name__.startswith(expected)


def test_lora_adapts_the_language_layers_and_the_merged_stream_is_the_policy(family: tuple[str, str]) -> None:
    """Packed rows (the padding-free layout: two samples in one row) through the adapted model: every adapter gets a
    gradient, and the merged stream loaded into the base model gives the adapted model's logits."""
    from easyrl.config.worker import LoraConfig
    from easyrl.workers.lora import apply_lora
    from easyrl.workers.packing import packed_attn_implementation

    name, path = family
    packed = ModelConfig(model_path=path)
    torch.manual_seed(0)
    model = load_model(packed, attn_implementation=packed_attn_implementation())
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    with torch.no_grad():  # peft starts B at zero: the adapted model would be the base
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.3)
    adapted = {n.split("layers.0.", 1)[1] for n in lora_layers(model) if "layers.0." in n}
    assert adapted == ADAPTED[name]
    assert not any(".visual." in n or ".experts" in n or n.endswith("mlp.gate") for n in lora_layers(model))
    ids = torch.randint(3, 250, (1, 24))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]  # two samples back to back
    if name not in TEXT:  # a VL model's packed row: the text positions, then M-RoPE's (text tokens: the same)
        positions = positions.expand(4, 1, -1)
    model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), "an adapter got no gradient"
    base = load_model(packed, attn_implementation=packed_attn_implementation())
    base.load_state_dict(dict(merged_weights(model, aliases=True)), strict=True)
    with torch.no_grad():
        merged = base(input_ids=ids, position_ids=positions).logits
        adapted_logits = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(merged, adapted_logits, rtol=0, atol=1e-5)


def test_engine_stream_has_the_checkpoint_layout(family: tuple[str, str]) -> None:
    """What vLLM is sent is what `save_pretrained` wrote: one matrix per expert (Qwen3 / Qwen3.5 MoE), Qwen3-VL MoE's
    fused experts transposed back, Qwen2.5-VL's legacy names, everything else as in memory."""
    name, path = family
    config = AutoConfig.from_pretrained(path)
    model = model_class_for(config).from_pretrained(path)
    convert = checkpoint_layout(config)
    # a model whose files transformers loads as they are is sent as it is held
    assert (convert is None) == (name in ("qwen3", "qwen3_vl", "qwen3_5"))
    stream = list(model.named_parameters())
    sent = dict(convert(stream)) if convert is not None else dict(stream)
    files = load_file(str(Path(path) / "model.safetensors"))
    assert sent.keys() == files.keys()
    for key, tensor in files.items():
        assert torch.equal(sent[key].detach(), tensor), key
    if name == "qwen3_vl_moe":  # (experts, hidden, 2 x expert width) in its files, (experts, 2 x width, hidden) held
        held = dict(stream)["model.language_model.layers.0.mlp.experts.gate_up_proj"]
        assert tuple(files["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 64)
        assert tuple(held.shape) == (4, 64, 64) and not torch.equal(held.transpose(1, 2), held)


def test_memory_plan_counts_every_parameter(family: tuple[str, str]) -> None:
    """The plan counts routed experts and Gated DeltaNet layers on the meta device, and caches keys and values for
    the full-attention layers only."""
    name, path = family
    config = AutoConfig.from_pretrained(path)
    model = model_class_for(config).from_pretrained(path)
    shape = ModelShape.from_hf_config(config)
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())
    assert shape.kv_layers == (1 if name.startswith("qwen3_5") else 2)
    if "moe" in name:  # a token's MLP work: its 2 experts of width 32 (and Qwen3.5's shared expert of 32)
        assert shape.intermediate_size == 2 * 32 + (32 if name == "qwen3_5_moe" else 0)


def test_packed_rows_give_the_padded_log_probs_and_gradients(family: tuple[str, str], tmp_path: Path) -> None:
    """The padding-free layout and the fused head against the padded rows: log-probs, entropies and every gradient
    (routed experts and routers included), with images, a video and a text-only row for the VL families."""
    from easyrl.workers.packing import packed_attn_implementation
    from easyrl.workers.specs import ForwardOptions
    from tests.workers.test_packing import make_batch
    from tests.workers.test_packing_vl import _batch, _loss_grads, _write_video

    name, path = family
    if name in TEXT:
        mb = make_batch(b=4, vocab=250)
    else:
        _write_video(tmp_path / "clip.mp4")
        mb = _batch(load_processor(path), tmp_path / "clip.mp4")
    padded = load_model(ModelConfig(model_path=path)).train()
    packed = load_model(ModelConfig(model_path=path), attn_implementation=packed_attn_implementation()).train()
    mask = mb["response_mask"].bool()
    ref_lp, ref_ent, ref_grads = _loss_grads(padded, mb, None)
    for opts in (ForwardOptions(padding_free=True), ForwardOptions(padding_free=True, fused=True, chunk_size=5)):
        lp, ent, grads = _loss_grads(packed, mb, opts)
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-5, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for key, ref in ref_grads.items():
            torch.testing.assert_close(grads[key], ref, atol=1e-5, rtol=1e-4, msg=key)
