"""Qwen3.5's linear-attention (Gated DeltaNet) layers under padding-free packing: each packed sample keeps its own
recurrent state and convolution window (easyrl.models.linear_attention), so a packed row gives each sample's log-probs
and gradients as if it ran alone; the unhooked transformers model does not, which is what makes the check bite.
Sequence parallelism, which would cut the recurrence between ranks, is refused with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config import ConfigError, ModelConfig, load_config
from easyrl.models import load_processor, model_class_for
from easyrl.models.linear_attention import has_linear_attention, keep_samples_apart, linear_attention_layers
from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
from easyrl.workers.forward_backward import token_log_probs
from easyrl.workers.model_setup import load_model
from easyrl.workers.packing import packed_attn_implementation
from easyrl.workers.specs import ForwardOptions
from tests.conftest import base_config, write_config
from tests.workers.test_packing_vl import CPU, _batch, _loss_grads, _write_video


PACKED = ForwardOptions(padding_free=True)
SLOW_DECAY = -4.0
"""A_log of every linear-attention head in the leak check: A = e^-4, so the state decays by ~1% a token and what one
sample leaves behind reaches well into the next (random init decays faster and hides the leak at ~1e-4)."""


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_5_moe"))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Batch]:
    """A tiny Qwen3.5 (layer 0 Gated DeltaNet, layer 1 full attention) and three rows: an image; a video and an
    image; text only."""
    root = tmp_path_factory.mktemp(request.param)
    path = build_tiny_vl_checkpoint(root / "model", request.param)
    _write_video(root / "clip.mp4")
    return path, _batch(load_processor(path), root / "clip.mp4")


def _slow_decay(model: Any) -> Any:
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.A_log"):
            param.data.fill_(SLOW_DECAY)
    return model


def _one_by_one(model: Any, mb: Batch) -> torch.Tensor:
    """Each row alone (a batch of one: nothing to share state with)."""
    with torch.no_grad():
        rows = [token_log_probs(model, mb.index([i]), CPU, 1.0, False, PACKED)[0] for i in range(len(mb))]
    return torch.cat(rows)


def test_packed_samples_do_not_share_recurrent_state(hybrid: tuple[str, Batch]) -> None:
    path, mb = hybrid
    attn = packed_attn_implementation()
    model = _slow_decay(load_model(ModelConfig(model_path=path), attn_implementation=attn)).eval()
    assert len(linear_attention_layers(model)) == 1
    mask = mb["response_mask"].bool()
    alone = _one_by_one(model, mb)
    with torch.no_grad():
        packed, _ = token_log_probs(model, mb, CPU, 1.0, False, PACKED)
    assert (packed - alone)[mask].abs().max() < 1e-5
    # transformers' own model on the same packed row: samples 2 and 3 start from their predecessor's state
    from transformers import AutoConfig

    raw = model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(
        path, attn_implementation={"text_config": attn, "vision_config": "sdpa"}
    )
    raw = _slow_decay(raw).eval()
    with torch.no_grad():
        leaky, _ = token_log_probs(raw, mb, CPU, 1.0, False, PACKED)
    gap = [float((leaky - alone)[i][mask[i]].abs().max()) for i in range(len(mb))]
    assert gap[0] < 1e-5  # the first sample has no predecessor
    assert min(gap[1:]) > 1e-3, f"the unhooked model no longer leaks state across samples ({gap}): re-check the fix"


def test_a_deep_copy_keeps_its_own_samples_apart_with_its_own_layers(hybrid: tuple[str, Batch]) -> None:
    """`copy.deepcopy` of a hooked model (tests build eager/compiled pairs that way): the copy's linear-attention
    layers run with its own weights and its own sample boundaries, and the original is untouched by the copy's
    passes. (The hooks once kept the original's bound forward and holder in closures: a copy ran the original's
    layers.)"""
    import copy

    path, mb = hybrid
    model = _slow_decay(load_model(ModelConfig(model_path=path), attn_implementation=packed_attn_implementation()))
    model.eval()
    with torch.no_grad():
        before, _ = token_log_probs(model, mb, CPU, 1.0, False, PACKED)
    twin = copy.deepcopy(model)
    for name, param in twin.named_parameters():
        if name.endswith("linear_attn.A_log"):
            param.data.fill_(SLOW_DECAY + 1.0)  # its own decay: its outputs must differ from the original's
    mask = mb["response_mask"].bool()
    with torch.no_grad():
        copied, _ = token_log_probs(twin, mb, CPU, 1.0, False, PACKED)
        after, _ = token_log_probs(model, mb, CPU, 1.0, False, PACKED)
    assert (copied - _one_by_one(twin, mb))[mask].abs().max() < 1e-5  # the copy keeps its samples apart
    assert (copied - before)[mask].abs().max() > 1e-4  # with its own layers' weights
    assert torch.equal(after, before)  # and the original is as it was


def test_packed_log_probs_and_gradients_equal_padded(hybrid: tuple[str, Batch]) -> None:
    """Every gradient, the linear-attention layers' (A_log, dt_bias, the convolution) included."""
    path, mb = hybrid
    padded = load_model(ModelConfig(model_path=path)).train()
    packed = load_model(ModelConfig(model_path=path), attn_implementation=packed_attn_implementation()).train()
    mask = mb["response_mask"].bool()
    ref_lp, ref_ent, ref_grads = _loss_grads(padded, mb, None)
    assert any("linear_attn.conv1d" in n for n in ref_grads) and any("linear_attn.A_log" in n for n in ref_grads)
    for opts in (PACKED, ForwardOptions(padding_free=True, fused=True, chunk_size=5)):
        lp, ent, grads = _loss_grads(packed, mb, opts)
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-5, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)


def test_other_calls_and_models_are_left_alone(hybrid: tuple[str, Batch], tmp_path: Path) -> None:
    """Padded batches and generation with a cache take the layer's own path; models without linear attention get
    no hooks; installing twice wraps nothing again."""
    path, mb = hybrid
    hooked = load_model(ModelConfig(model_path=path)).eval()
    from transformers import AutoConfig

    plain = model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(path).eval()
    ids, attn = mb["input_ids"], mb["attention_mask"]
    media = dict(mb["multi_modal_inputs"][0])
    with torch.no_grad():
        torch.testing.assert_close(
            hooked(input_ids=ids, attention_mask=attn).logits, plain(input_ids=ids, attention_mask=attn).logits
        )
        one = mb["input_ids"][:1, attn[0].bool()]
        gen = {"max_new_tokens": 4, "do_sample": False}
        assert torch.equal(
            hooked.generate(input_ids=one, **media, **gen), plain.generate(input_ids=one, **media, **gen)
        )
    assert keep_samples_apart(hooked) == 0
    assert has_linear_attention(hooked.config) and has_linear_attention(AutoConfig.from_pretrained(path).to_dict())
    dense = build_tiny_vl_checkpoint(tmp_path / "dense", "qwen3_vl")
    assert keep_samples_apart(load_model(ModelConfig(model_path=dense))) == 0
    assert not has_linear_attention(AutoConfig.from_pretrained(dense))


def test_sequence_parallel_is_refused_with_one_line(hybrid: tuple[str, Batch], tmp_path: Path, digits_data) -> None:
    path, _ = hybrid
    conf = base_config(path, digits_data, tmp_path / "run")
    overrides = ["worker.actor.padding_free=true", "worker.actor.ulysses_size=2"]
    with pytest.raises(ConfigError, match=r"^worker.actor.ulysses_size: 2 splits each row over ranks, but the linear"):
        load_config(write_config(tmp_path / "c.yaml", conf), overrides)
    ring = ["worker.actor.padding_free=true", "worker.actor.ring_size=2"]  # ring attention splits the row as well
    with pytest.raises(ConfigError, match=r"^worker.actor.ring_size: 2 splits each row over ranks, but the linear"):
        load_config(write_config(tmp_path / "c.yaml", conf), ring)
