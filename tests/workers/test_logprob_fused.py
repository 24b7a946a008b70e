"""The fused (chunked) log-prob + entropy head equals full logits: values and gradients, alone, through a model,
and under FSDP2 with 2 gloo ranks (the head weight is the root unit's, tied to the embedding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from easyrl.algorithms import entropy_from_logits, logprobs_from_logits
from easyrl.workers.forward_backward import token_log_probs
from easyrl.workers.head_grad import vocab_block
from easyrl.workers.packing import fused_linear_logprobs
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing import make_batch, tiny_lm


CPU = torch.device("cpu")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_head_matches_full_logits(temperature: float, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 32, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (0.3 * torch.randn(300, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 300, (50,), generator=g)
    g_lp, g_ent = torch.randn(50, generator=g), torch.randn(50, generator=g)

    lp, ent = fused_linear_logprobs(hidden, weight, labels, temperature, chunk)
    (lp * g_lp + ent * g_ent).sum().backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = (hidden @ weight.T) / temperature
    ref_lp, ref_ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused_grads[0], hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused_grads[1], weight.grad, atol=1e-5, rtol=1e-5)  # sums of 50 O(1) terms


def test_fused_head_log_prob_only_gradient() -> None:
    """Only the log-probs used (entropy unused: its gradient is None in backward)."""
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (9,))
    lp, _ = fused_linear_logprobs(hidden, weight, labels, 1.0, 4)
    lp.sum().backward()
    (hw, ww), hidden.grad, weight.grad = (hidden.grad.clone(), weight.grad.clone()), None, None
    logprobs_from_logits(hidden @ weight.T, labels).sum().backward()
    torch.testing.assert_close(hw, hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ww, weight.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_fused_model_path_matches_plain(tie: bool) -> None:
    model, mb = tiny_lm(tie=tie).train(), make_batch(seed=2)
    mask = mb["response_mask"].bool()
    out = {}
    for key, opts in (("plain", None), ("fused", ForwardOptions(fused=True, chunk_size=8))):
        model.zero_grad(set_to_none=True)
        lp, ent = token_log_probs(model, mb, CPU, 0.8, with_entropy=True, opts=opts)
        assert ent is not None
        ((lp * mb["advantages"] + 0.1 * ent) * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[key] = (lp[mask], ent[mask], grads)
    torch.testing.assert_close(out["fused"][0], out["plain"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["fused"][1], out["plain"][1], atol=1e-5, rtol=0)
    for name, grad in out["plain"][2].items():
        torch.testing.assert_close(out["fused"][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _fsdp_worker(rank: int, world: int, model_dir: str, out: str) -> None:

    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.model_setup import load_model, shard_model

    init_rank(rank, world)
    mb = make_batch(b=4, seed=20 + rank, vocab=90)
    mask = mb["response_mask"].bool()
    res: dict[str, dict[str, list]] = {}
    for key, opts in (("plain", None), ("fused", ForwardOptions(fused=True, padding_free=True, chunk_size=6))):
        model = shard_model(load_model(ModelConfig(model_path=model_dir)), FSDPConfig(), CPU).train()
        lp, ent = token_log_probs(model, mb, CPU, 0.9, with_entropy=True, opts=opts)
        assert ent is not None
        ((lp * mb["advantages"] + 0.1 * ent) * mask).sum().backward()
        # the reduce-scattered gradient shards, gathered: the same on every rank
        grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}
        res[key] = {"lp": lp[mask].tolist(), "ent": ent[mask].tolist(), **grads}
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    close_rank()


def test_fused_and_packed_under_fsdp2_two_ranks(tmp_path, tiny_model_dir) -> None:
    out = tmp_path / "res.json"
    run_ranks(_fsdp_worker, 2, tiny_model_dir, str(out))
    res = json.loads(out.read_text())
    assert res["plain"].keys() == res["fused"].keys()
    for name, ref in res["plain"].items():
        torch.testing.assert_close(torch.tensor(res["fused"][name]), torch.tensor(ref), atol=1e-5, rtol=1e-4, msg=name)


def test_vocab_blocks_hold_no_more_logits_than_a_forward_chunk() -> None:
    """The backward's blocks of columns: the whole vocabulary for a micro-batch of at most `chunk` rows, otherwise
    at most chunk x V logits a block, a multiple of 128 columns where that many fit."""
    assert vocab_block(1024, 151_936, 1024) == vocab_block(3, 151_936, 1024) == 151_936
    for rows, vocab, chunk in ((16_384, 151_936, 1024), (2500, 151_936, 1024), (50, 300, 7)):
        cols = vocab_block(rows, vocab, chunk)
        assert 1 <= cols < vocab and rows * cols <= chunk * vocab, (rows, vocab, chunk, cols)
        assert cols % 128 == 0 or cols < 128
    assert vocab_block(16_384, 151_936, 1024) == 9472  # 17 blocks, the last one ragged
    assert vocab_block(10**6, 300, 1) == 1  # past chunk x V rows: one column, the least a block can be


class Allocations(TorchDispatchMode):
    """Every tensor an op returns while active: (dtype, numel)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("n", [40, 47])  # 4 blocks of 125 columns; 4 of 106 and a ragged one of 76
def test_bf16_backward_builds_no_vh_buffer_and_keeps_bf16_precision(n: int) -> None:
    """Issue 44: no fp32 (V, H) temporary. Every tensor the backward makes is recorded: none has V x H fp32
    values (the row-chunked backward summed grad_W in one), no fp32 block is larger than the forward's chunk, and
    the gradients are within bf16 rounding of an fp64 reference."""
    h_dim, vocab, chunk = 64, 500, 10
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, h_dim, generator=g).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(vocab, h_dim, generator=g)).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    cols = vocab_block(n, vocab, chunk)
    labels[:4] = torch.tensor([0, cols - 1, cols, vocab - 1])  # the first block's edges, the last column
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent = fused_linear_logprobs(hidden, weight, labels, 0.7, chunk)
    loss = (lp * g_lp + ent * g_ent).sum()
    with Allocations() as mode:
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
    fp32 = [numel for dtype, numel in mode.seen if dtype == torch.float32]
    assert max(fp32) <= chunk * vocab < vocab * h_dim, max(fp32)
    assert gh.dtype == gw.dtype == torch.bfloat16

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = (h64 @ w64.T) / 0.7
    ref = (logprobs_from_logits(logits, labels) * g_lp + entropy_from_logits(logits) * g_ent).sum()
    for got, want in zip((gh, gw), torch.autograd.grad(ref, (h64, w64))):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2**-6, err  # bf16 logits and gradients (8 bits of mantissa), each rounded once
