"""Grouped-query attention in the packed (varlen) attention: how the kernel is called is decided once from what it
takes, and fewer key/value heads passed natively give what repeated heads give."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from easyrl.workers.varlen import _segment_sdpa, attention_kernel, gqa_mode, repeat_kv_heads


def _never_probe() -> bool:
    raise AssertionError("the probe must not run when the signature already answers")


def test_gqa_mode_from_signature_then_probe() -> None:
    with_flag = frozenset({"query", "key", "value", "window_size", "enable_gqa"})
    without = frozenset({"query", "key", "value", "is_causal", "scale"})  # torch 2.10 / 2.11 style
    assert gqa_mode(with_flag, _never_probe) == "flag"
    assert gqa_mode(without, lambda: True) == "native"
    assert gqa_mode(without, lambda: False) == "repeat"


@pytest.mark.parametrize(("hq", "hkv"), [(8, 1), (6, 2), (4, 4)])
def test_native_gqa_equals_repeated_kv(hq: int, hkv: int) -> None:
    """Packed sequences of 3, 5 and 4 tokens: attention with Hkv heads (GQA) and with each repeated Hq/Hkv times agree,
    outputs and the gradients reaching the unrepeated key/value heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, hq, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(12, hkv, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 3, 8, 12])
    native = _segment_sdpa(q, k, v, cu, 0.25)
    (g_native,) = torch.autograd.grad(native.sum(), [k])
    repeated = _segment_sdpa(q, *repeat_kv_heads(k, v, hq), cu, 0.25)
    (g_repeated,) = torch.autograd.grad(repeated.sum(), [k])
    assert native.shape == (12, hq, 16)
    torch.testing.assert_close(native, repeated)
    torch.testing.assert_close(g_native, g_repeated)
    # query head h reads key/value head h // (hq / hkv): moving one KV head changes exactly its group's outputs
    moved = v.detach().clone()
    moved[:, -1] += 1.0
    changed = (_segment_sdpa(q.detach(), k.detach(), moved, cu, 0.25) - native.detach()).abs().amax(dim=(0, 2)) > 0
    assert changed.tolist() == [h // (hq // hkv) == hkv - 1 for h in range(hq)]


def test_attention_kernel_says_which_runs() -> None:
    assert attention_kernel(padding_free=False).startswith("transformers' default attention")
    if not torch.cuda.is_available():
        assert attention_kernel(padding_free=True) == "easyrl_varlen: per-sequence sdpa (CPU), GQA native (enable_gqa)"


@pytest.mark.gpu
def test_torch_varlen_gqa_equals_repeated_kv_on_gpu() -> None:
    """On the GPU image's torch: the kernel's GQA call (flag, unflagged or repeated, as `gqa_support` found) gives
    what the kernel gives for repeated key/value heads; `easyrl check` names the same mode."""
    from easyrl.workers.varlen import _torch_varlen, gqa_support

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(40, 14, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(40, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 9, 31, 40], device="cuda", dtype=torch.int32)
    out = _torch_varlen(q, k, v, cu, 22, 0.125)
    ref = _torch_varlen(q, *repeat_kv_heads(k, v, 14), cu, 22, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    native = {"flag": "enable_gqa", "native": "fewer K/V heads accepted", "repeat": "repeating K/V"}[gqa_support()]
    if importlib.util.find_spec("flash_attn") is None:  # else packed training runs flash-attn, and check says so
        assert native in attention_kernel(padding_free=True)
