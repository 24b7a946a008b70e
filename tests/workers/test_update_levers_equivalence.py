"""The update levers of issue 44 on real FSDP2 updates over gloo (2 CPU ranks): gradient checkpointing gives the
same update bit for bit, the deferred gradient sync (one reduction per mini-batch) the synced one within float
tolerance while really holding the reduction back, and the forward-only budget the same log-probs in fewer passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing import make_batch, tiny_lm


CPU = torch.device("cpu")
SETTINGS = {"base": (False, False), "checkpointing": (True, False), "deferred": (False, True)}
"""name -> (gradient checkpointing, deferred gradient sync)."""


def _loss_fn(model: torch.nn.Module, reduced: list[bool]) -> Any:
    """A policy-gradient-like loss; records, at each micro-batch's forward, whether any sharded parameter holds a
    gradient yet (FSDP2 writes the sharded gradient only when it reduces)."""
    from easyrl.workers.forward_backward import MicroBatchLoss, token_log_probs

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        reduced.append(any(p.grad is not None for p in model.parameters()))
        lp, _ = token_log_probs(model, mb, CPU, 1.0, False)
        mask = on_device["response_mask"].float()
        loss = -(lp * on_device["advantages"] * mask).sum() / mask.sum().clamp(min=1)
        return MicroBatchLoss(loss, {"actor/pg_loss": loss.detach()}, {})

    return loss_fn


def _levers_worker(rank: int, world: int, model_dir: str, out: str) -> None:

    from easyrl.config import FSDPConfig, ModelConfig, OptimConfig
    from easyrl.workers.forward_backward import optimize
    from easyrl.workers.model_setup import build_scheduler, iter_full_weights, load_model, shard_model

    init_rank(rank, world)
    batch = make_batch(b=8, p=16, r=12, seed=20 + rank)  # two mini-batches of 4 rows, micro-batches of 3 + 1
    results: dict[str, Any] = {}
    for name, (checkpointing, deferred) in SETTINGS.items():
        model = shard_model(load_model(ModelConfig(model_path=model_dir)), FSDPConfig(), CPU, checkpointing)
        model.train()
        optim = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD: the update is the gradient itself
        sched = build_scheduler(optim, OptimConfig(), 10)
        reduced: list[bool] = []
        metrics = optimize(
            model, optim, sched, batch, device=CPU, mini_batch_size=4, micro_batch_size=3, epochs=1,
            max_grad_norm=1e9, loss_fn=_loss_fn(model, reduced), prefix="actor", defer_gradient_sync=deferred,
        )  # fmt: skip
        weights = {n: t.tolist() for n, t in iter_full_weights(model)}
        results[name] = {"metrics": metrics, "weights": weights, "reduced": reduced}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    close_rank()


def test_levers_give_the_same_update_on_two_ranks(tmp_path: Path, tiny_model_dir: str) -> None:
    out = tmp_path / "levers.json"
    run_ranks(_levers_worker, 2, tiny_model_dir, str(out))
    res = json.loads(out.read_text())
    base, ckpt, deferred = res["base"], res["checkpointing"], res["deferred"]
    # checkpointing recomputes the same forward: the update and every metric are bit-identical
    assert ckpt["metrics"] == base["metrics"] and ckpt["weights"] == base["weights"]
    # each mini-batch: micro-batch 2's forward sees micro-batch 1 reduced when synced, nothing reduced when deferred
    assert base["reduced"] == [False, True, False, True]
    assert deferred["reduced"] == [False, False, False, False]
    for name in base["weights"]:
        torch.testing.assert_close(
            torch.tensor(deferred["weights"][name]), torch.tensor(base["weights"][name]), atol=1e-6, rtol=0, msg=name
        )
    for key, value in base["metrics"].items():
        assert abs(deferred["metrics"][key] - value) <= 1e-6 * max(1.0, abs(value)), key


def test_forward_only_budget_gives_the_same_log_probs_in_fewer_passes() -> None:
    """`ForwardOptions.log_prob_max_token_len` sizes the old/reference passes' micro-batches (not the update's): 10
    rows in passes of up to 40 tokens, then of up to 400 tokens, with the same log-probs and entropies."""
    model, batch = tiny_lm(), make_batch(b=10, seed=3)
    mask = batch["response_mask"].bool()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    small = batched_log_probs(model, batch, CPU, 1.0, 3, True, ForwardOptions(max_token_len=40))
    passes_small, calls[:] = len(calls), []
    large_opts = ForwardOptions(max_token_len=40, log_prob_max_token_len=400)
    assert large_opts.forward_only_token_len == 400 and ForwardOptions().forward_only_token_len is None
    large = batched_log_probs(model, batch, CPU, 1.0, 3, True, large_opts)
    assert len(calls) < passes_small, (len(calls), passes_small)
    for got, want in zip(large, small):
        assert got is not None and want is not None
        torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=0)
