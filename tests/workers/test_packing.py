"""Padding-free (packed) forward passes give the padded path's log-probs, entropies, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from easyrl.batch import Batch
from easyrl.workers.forward_backward import response_values, token_log_probs
from easyrl.workers.packing import prepare_inputs
from easyrl.workers.specs import ForwardOptions


CPU = torch.device("cpu")
VOCAB = 160


def make_batch(b: int = 6, p: int = 12, r: int = 10, vocab: int = VOCAB, seed: int = 0) -> Batch:
    """Random token ids, left-padded prompts and right-padded responses of varied lengths (as the engines emit)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        pl = int(torch.randint(1, p + 1, (), generator=g))
        rl = int(torch.randint(1, r + 1, (), generator=g))
        mask[i, p - pl : p] = 1
        mask[i, p : p + rl] = 1
    ids = torch.randint(3, vocab, (b, p + r), generator=g) * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return Batch(
        {
            "prompts": ids[:, :p],
            "responses": ids[:, p:],
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            "response_mask": mask[:, p:].clone(),
            "loss_mask": mask[:, p:].clone(),
            "advantages": torch.randn(b, r, generator=g),
        }
    )


def tiny_lm(arch: str = "qwen2", tie: bool = True, seed: int = 0) -> torch.nn.Module:
    """A 2-layer fp32 causal LM with sdpa attention (transformers' default)."""
    cls_cfg, cls_model = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cls_cfg(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return cls_model(cfg).eval()


def test_prepare_inputs_layouts() -> None:
    mb = make_batch()
    mask = mb["attention_mask"].bool()
    packed = prepare_inputs(mb, padding_free=True)
    assert packed.attention_mask is None and packed.input_ids.shape == (1, int(mask.sum()))
    assert torch.equal(packed.input_ids[0], mb["input_ids"][mask])
    # every packed sequence restarts at position 0
    assert int((packed.position_ids[0] == 0).sum()) == len(mb)
    n_resp = int(mask[:, -mb["responses"].shape[1] :].sum())
    assert packed.select.shape == packed.labels.shape == packed.dest.shape == (n_resp,)
    trimmed = prepare_inputs(mb, padding_free=False)
    assert trimmed.input_ids.shape[0] == len(mb) and trimmed.input_ids.shape[1] <= mb["input_ids"].shape[1]
    # the selected position's next token is the label, in both layouts
    for lay in (packed, trimmed):
        flat = lay.input_ids.reshape(-1)
        assert torch.equal(flat[lay.select + 1], lay.labels)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_equal_padded(arch: str, temperature: float) -> None:
    model, mb = tiny_lm(arch), make_batch()
    mask = mb["response_mask"].bool()
    ref_lp, ref_ent = token_log_probs(model, mb, CPU, temperature, with_entropy=True)
    for opts in (ForwardOptions(padding_free=True), ForwardOptions(padding_free=True, fused=True, chunk_size=7)):
        lp, ent = token_log_probs(model, mb, CPU, temperature, with_entropy=True, opts=opts)
        assert ent is not None and ref_ent is not None
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-5, rtol=0)
        assert torch.all(lp[~mask] == 0)  # padding gives 0, not garbage


def _grads(model: torch.nn.Module, mb: Batch, opts: ForwardOptions | None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lp, ent = token_log_probs(model, mb, CPU, 0.9, with_entropy=True, opts=opts)
    assert ent is not None
    mask = mb["response_mask"].float()
    ((lp * mb["advantages"] * mask).sum() + 0.1 * (ent * mask).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_gradients_equal_padded() -> None:
    model, mb = tiny_lm(), make_batch(seed=3)
    model.train()
    ref = _grads(model, mb, None)
    got = _grads(model, mb, ForwardOptions(padding_free=True))
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_values_equal_padded() -> None:
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    cfg.num_labels = 1
    torch.manual_seed(0)
    critic = Qwen2ForTokenClassification(cfg).eval()
    mb = make_batch(seed=5)
    ref = response_values(critic, mb, CPU)
    for opts in (ForwardOptions(padding_free=True), ForwardOptions(max_token_len=64)):
        torch.testing.assert_close(response_values(critic, mb, CPU, opts), ref, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_packed_flash_attention_equals_padded_on_gpu() -> None:
    """GPU only (not run in the CPU sessions): bf16 flash-attention varlen (packed) vs padded sdpa."""
    pytest.importorskip("flash_attn")
    dev = torch.device("cuda")
    model = tiny_lm().to(dev, torch.bfloat16)
    mb = make_batch()
    mask = mb["response_mask"].bool()
    ref, _ = token_log_probs(model, mb, dev, 1.0, with_entropy=False)
    model.set_attn_implementation("flash_attention_2")
    lp, _ = token_log_probs(model, mb, dev, 1.0, with_entropy=False, opts=ForwardOptions(padding_free=True))
    torch.testing.assert_close(lp[mask.to(dev)], ref[mask.to(dev)], atol=BF16_ATOL, rtol=0)


def _varlen(model: torch.nn.Module) -> torch.nn.Module:
    from easyrl.workers.varlen import register_varlen_attention

    model.set_attn_implementation(register_varlen_attention())
    return model


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_varlen_attention_equals_padded(arch: str) -> None:
    """easyrl_varlen (per-sequence attention on CPU) on packed rows: the padded sdpa path's log-probs and grads."""
    padded, packed = tiny_lm(arch), _varlen(tiny_lm(arch))
    mb = make_batch(seed=7)
    mask = mb["response_mask"].bool()
    ref, _ = token_log_probs(padded, mb, CPU, 1.0, with_entropy=False)
    lp, _ = token_log_probs(packed, mb, CPU, 1.0, with_entropy=False, opts=ForwardOptions(padding_free=True))
    torch.testing.assert_close(lp[mask], ref[mask], atol=1e-5, rtol=0)
    padded.train(), packed.train()
    ref_grads = _grads(padded, mb, None)
    got = _grads(packed, mb, ForwardOptions(padding_free=True, fused=True, chunk_size=5))
    for name in ref_grads:
        torch.testing.assert_close(got[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


BF16_ATOL = 5e-2
"""Per-token log-prob tolerance of packed vs padded in bf16 on the GPU (flash kernels): the two paths sum in different
orders, and bf16 keeps 8 bits of mantissa."""


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_varlen_attention_equals_padded_in_bf16(arch: str) -> None:
    """The same comparison in bf16 on CPU: measured max 2.1e-3, mean 6e-4 (log-probs around -5); bounded at 1e-2 and
    2e-3."""
    padded, packed = tiny_lm(arch).to(torch.bfloat16), _varlen(tiny_lm(arch).to(torch.bfloat16))
    mb = make_batch(b=8, p=24, r=20, seed=3)
    mask = mb["response_mask"].bool()
    ref, _ = token_log_probs(padded, mb, CPU, 1.0, with_entropy=False)
    lp, _ = token_log_probs(packed, mb, CPU, 1.0, with_entropy=False, opts=ForwardOptions(padding_free=True))
    torch.testing.assert_close(lp[mask], ref[mask], atol=1e-2, rtol=0)
    assert (lp[mask] - ref[mask]).abs().mean() < 2e-3


def test_varlen_attention_refuses_padded_rows() -> None:
    model, mb = _varlen(tiny_lm()), make_batch()
    with pytest.raises(RuntimeError, match="one packed row with its position_ids"):
        token_log_probs(model, mb, CPU, 1.0, with_entropy=False)


@pytest.mark.gpu
def test_varlen_attention_torch_kernel_equals_padded_on_gpu() -> None:
    """GPU only: torch's flash varlen kernel (packed, bf16) vs padded sdpa, GQA model."""
    dev = torch.device("cuda")
    padded = tiny_lm().to(dev, torch.bfloat16)
    packed = _varlen(tiny_lm().to(dev, torch.bfloat16))
    mb = make_batch()
    mask = mb["response_mask"].bool().to(dev)
    ref, _ = token_log_probs(padded, mb, dev, 1.0, with_entropy=False)
    lp, _ = token_log_probs(packed, mb, dev, 1.0, with_entropy=False, opts=ForwardOptions(padding_free=True))
    torch.testing.assert_close(lp[mask], ref[mask], atol=BF16_ATOL, rtol=0)
