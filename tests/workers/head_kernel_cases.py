"""The cases of `worker.actor.fused_head_kernel: triton` (easyrl.workers.head_kernel) on CPU, in Triton's
interpreter: the same values and gradients as the torch fused head and an fp64 reference (temperature, entropy and
top-1, a ragged last chunk, a vocabulary that is not a multiple of the tile), and the same refusals.

Run by tests/workers/test_head_kernel.py in a process of their own with TRITON_INTERPRET=1: the interpreter must be
on when triton is first imported (its `tl` helpers are jitted then), and a test session imports triton early
(transformers does). The CUDA comparison (bf16, peak memory) is tests/workers/test_head_kernel_gpu.py."""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

from easyrl.workers.forward_backward import token_log_probs
from easyrl.workers.packing import fused_linear_logprobs
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_logprob_fused import Allocations
from tests.workers.test_packing import make_batch, tiny_lm


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/workers/test_head_kernel.py, with TRITON_INTERPRET=1", allow_module_level=True)

KERNEL = "easyrl.workers.head_kernel"
N, H, V, CHUNK, BLOCK = 13, 16, 100, 5, 32  # chunks of 5, 5, 3 rows; tiles of 32, 32, 32, 4 columns


@pytest.fixture(scope="module")
def interpreted() -> ModuleType:
    """The kernel module, its kernels decorated in interpreter mode."""
    import easyrl.workers.head_kernel as module

    assert module.INTERPRETED
    return module


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (0.5 * torch.randn(V, H, generator=g)).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels, torch.randn(N, generator=g), torch.randn(N, generator=g)


def _run(kernel: str, hidden, weight, labels, g_lp, g_ent, temperature: float, second: str):
    """Values and the gradients (hidden, weight) of g_lp . logp + g_ent . entropy (the flag has none)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if kernel == "fp64":
        z = (h.double() @ w.double().T) / temperature
        logp_all = torch.log_softmax(z, dim=-1)
        lp = logp_all.gather(1, labels[:, None]).squeeze(1)
        sec = -(logp_all.exp() * logp_all).sum(-1) if second == "entropy" else (z.argmax(-1) == labels).double()
    else:
        lp, sec = fused_linear_logprobs(h, w, labels, temperature, CHUNK, second, kernel)
    loss = (lp * g_lp.to(lp.dtype)).sum() + ((sec * g_ent.to(sec.dtype)).sum() if second == "entropy" else 0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp.double(), sec.double(), gh.double(), gw.double()


@pytest.mark.parametrize(
    ("dtype", "temperature", "second"),
    [
        (torch.float32, 1.0, "entropy"),
        (torch.float32, 0.7, "top1"),
        (torch.bfloat16, 0.7, "entropy"),
        (torch.bfloat16, 1.0, "top1"),
    ],
)
def test_triton_head_matches_the_torch_head_and_fp64(interpreted, dtype, temperature, second, monkeypatch) -> None:
    # Small tiles: four per row, the last one 4 columns wide (the masked tail)
    monkeypatch.setattr(interpreted, "_MAX_BLOCK_V", BLOCK)
    args = _inputs(dtype)
    tri, ref, exact = (_run(k, *args, temperature, second) for k in ("triton", "torch", "fp64"))
    assert tri[0].dtype == torch.float64 and tri[2].shape == (N, H) and tri[3].shape == (V, H)
    torch.testing.assert_close(tri[1], ref[1], atol=1e-5, rtol=0)  # entropy, or the same top-1 flags
    torch.testing.assert_close(tri[0], ref[0], atol=1e-5, rtol=0)
    for name, t, r, e in zip(("logp", "second", "grad_hidden", "grad_weight"), tri, ref, exact):
        scale = e.abs().max().item() or 1.0  # top-1 flags may all be 0
        err_tri, err_ref = (t - e).abs().max().item() / scale, (r - e).abs().max().item() / scale
        # fp32: both within float rounding of fp64; bf16: the gradients are rounded to bf16 once (grad_z, then the
        # matmuls' outputs), as the torch head's, so the Triton head's error is the torch head's order
        bound = 1e-5 if dtype == torch.float32 else max(3 * err_ref, 2**-8)
        assert err_tri <= bound, f"{name}: relative error {err_tri:.2e} against fp64 (torch head {err_ref:.2e})"


def test_one_statistic_at_a_time_and_one_chunk(interpreted) -> None:
    """Only the log-probs or only the entropy carries a gradient (the other's is None in the backward), and a
    micro-batch that fits one chunk (its backward one block of the whole vocabulary: grad_h written once, no sum)."""
    hidden, weight, labels, g_lp, _ = _inputs(torch.float32, seed=1)
    for use, chunk in (("logp", CHUNK), ("entropy", CHUNK), ("logp", 64)):
        grads = []
        for kernel in ("triton", "torch"):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, ent = fused_linear_logprobs(h, w, labels, 0.9, chunk, "entropy", kernel)
            ((lp if use == "logp" else ent) * g_lp).sum().backward()
            grads.append((h.grad, w.grad))
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_top1_takes_the_first_of_tied_maxima_across_tiles(interpreted, monkeypatch) -> None:
    """torch's argmax is the first index of the maximum: a label tied with an earlier column (in another tile) is
    not the top-1 token, the earlier one is."""
    monkeypatch.setattr(interpreted, "_MAX_BLOCK_V", BLOCK)
    hidden, weight, _, _, _ = _inputs(torch.float32, seed=2)
    weight[70] = weight[3] = 3 * hidden[0]  # columns 3 (tile 0) and 70 (tile 2) tie at the max of row 0
    labels = torch.tensor([3, 70] + [5] * (N - 2))
    hidden[1] = hidden[0]
    for kernel in ("triton", "torch"):
        _, top1 = fused_linear_logprobs(hidden, weight, labels, 1.0, CHUNK, "top1", kernel)
        assert top1[:2].tolist() == [1.0, 0.0], kernel


def test_an_empty_micro_batch_and_greedy(interpreted) -> None:
    hidden, weight = torch.zeros(0, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    lp, ent = fused_linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), 1.0, CHUNK, "entropy", "triton")
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, H) and torch.equal(weight.grad, torch.zeros(V, H))
    with pytest.raises(ValueError, match=r"^temperature 0.0: worker.rollout.temperature must be > 0"):
        fused_linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), 0.0, CHUNK, "entropy", "triton")
    with pytest.raises(ValueError, match=r"^worker.actor.fused_head_kernel='cuda': choose one of torch, triton$"):
        fused_linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), 1.0, CHUNK, "entropy", "cuda")


def test_through_the_model_as_the_torch_head(interpreted) -> None:
    """`token_log_probs` with `ForwardOptions(head_kernel="triton")`: the backbone, then this head; the same
    log-probs, entropy and every parameter's gradient as the torch head."""
    model, mb = tiny_lm().train(), make_batch(seed=3)
    mask = mb["response_mask"].bool()
    out = {}
    for kernel in ("torch", "triton"):
        model.zero_grad(set_to_none=True)
        opts = ForwardOptions(fused=True, chunk_size=8, head_kernel=kernel)
        lp, ent = token_log_probs(model, mb, torch.device("cpu"), 0.8, with_entropy=True, opts=opts)
        assert ent is not None
        ((lp * mb["advantages"] + 0.1 * ent) * mask).sum().backward()
        out[kernel] = (lp[mask], ent[mask], {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], atol=1e-5, rtol=0)
    for name, grad in out["torch"][2].items():
        torch.testing.assert_close(out["triton"][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_refused_where_it_cannot_run(interpreted, monkeypatch) -> None:
    """Compiled kernels (not the interpreter) on a CPU tensor, and triton missing: one line each, naming the fix."""
    hidden, weight, labels, _, _ = _inputs(torch.float32)
    monkeypatch.setattr(interpreted, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match=r"^worker.actor.fused_head_kernel=triton runs on CUDA, .*set it to torch$"):
        fused_linear_logprobs(hidden, weight, labels, 1.0, CHUNK, "entropy", "triton")
    monkeypatch.delitem(sys.modules, KERNEL)
    monkeypatch.setitem(sys.modules, "triton", None)  # what Python's import sees when a package is absent
    with pytest.raises(RuntimeError, match=r"^worker.actor.fused_head_kernel=triton: cannot import triton .*\[gpu\]"):
        fused_linear_logprobs(hidden, weight, labels, 1.0, CHUNK, "entropy", "triton")


def test_a_bf16_backward_makes_no_vh_buffer(interpreted, monkeypatch) -> None:
    """Over several blocks of vocabulary columns (13 rows, chunks of 5: blocks of 38 columns), no tensor the
    backward makes holds fp32 values beyond one forward chunk's count (chunk x V): no fp32 (V, H) sum of grad_W, and
    no fp32 logits block (the kernel works in place on the bf16 block)."""
    monkeypatch.setattr(interpreted, "_MAX_BLOCK_V", BLOCK)
    hidden, weight, labels, g_lp, g_ent = _inputs(torch.bfloat16, seed=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(h, w, labels, 0.7, CHUNK, "entropy", "triton")
    loss = (lp * g_lp).sum() + (ent * g_ent).sum()
    with Allocations() as mode:
        gh, gw = torch.autograd.grad(loss, (h, w))
    fp32 = [numel for dtype, numel in mode.seen if dtype == torch.float32]
    assert max(fp32) < CHUNK * V < V * H, max(fp32)
    assert gh.dtype == gw.dtype == torch.bfloat16
