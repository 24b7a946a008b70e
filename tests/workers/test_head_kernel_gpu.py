"""`worker.actor.fused_head_kernel: triton` on CUDA in bf16 at a Qwen2.5-1.5B head (vocabulary 151,936, hidden 1,536):
the same log-probs, entropy and gradients as the torch head within bf16 rounding (each measured against an fp32
reference), and a lower peak of memory over forward + backward (no fp32 (chunk, V) blocks; neither head builds an fp32
(V, H) sum: both backwards go by blocks of vocabulary columns, easyrl/workers/head_grad.py). The CPU cases (Triton's interpreter) are tests/workers/head_kernel_cases.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from easyrl.workers.packing import fused_linear_logprobs


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton not installed: pip install -e '.[gpu]'"
    ),
]

N, H, V, CHUNK, T = 2500, 1536, 151_936, 1024, 0.8  # three chunks, the last one ragged


def _run(kernel: str, hidden, weight, labels, g_lp, g_ent):
    """Values, gradients (fp32 copies) and the peak memory above the inputs of one forward + backward."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if kernel == "fp32":  # the reference: full fp32 logits of the same bf16 inputs
        z = (h.float() @ w.float().T) / T
        logp_all = torch.log_softmax(z, dim=-1)
        lp, ent = logp_all.gather(1, labels[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)
    else:
        lp, ent = fused_linear_logprobs(h, w, labels, T, CHUNK, "entropy", kernel)
    gh, gw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return (lp.detach().float(), ent.detach().float(), gh.float(), gw.float()), peak


def test_triton_head_matches_the_torch_head_in_bf16_with_a_lower_peak() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (0.02 * torch.randn(V, H, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    tri, tri_peak = _run("triton", hidden, weight, labels, g_lp, g_ent)
    ref, ref_peak = _run("torch", hidden, weight, labels, g_lp, g_ent)
    exact, _ = _run("fp32", hidden, weight, labels, g_lp, g_ent)
    # The same bf16 logits read with fp32 math: the values agree to fp32 summation order
    torch.testing.assert_close(tri[0], ref[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(tri[1], ref[1], atol=2e-3, rtol=0)
    for name, t, r, e in zip(("logp", "entropy", "grad_hidden", "grad_weight"), tri, ref, exact):
        scale = e.abs().max().item()
        err_tri, err_ref = (t - e).abs().max().item() / scale, (r - e).abs().max().item() / scale
        print(f"{name}: relative error against fp32, triton {err_tri:.2e}, torch {err_ref:.2e}")
        assert err_tri <= max(1.5 * err_ref, 2**-8), f"{name}: {err_tri:.2e} against fp32 (torch head {err_ref:.2e})"
    print(f"peak above the inputs: triton {tri_peak / 2**20:.0f} MiB, torch {ref_peak / 2**20:.0f} MiB")
    # The torch head holds fp32 logits and probabilities of each (1024 x V)-sized block (0.6 GiB each); the Triton
    # head one bf16 block
    assert tri_peak < 0.7 * ref_peak, (tri_peak, ref_peak)
