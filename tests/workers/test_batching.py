"""Dynamic batching: balanced token-budget partitions, unchanged log-probs, and the same optimizer step as fixed-count
micro-batches (FSDP2 over gloo, 1 and 2 ranks); bf16 optimizer states; one real 2-worker run."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from easyrl.batch import Batch
from easyrl.workers.batching import balanced_partition, make_micro_batches
from easyrl.workers.forward_backward import batched_log_probs
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_packing import make_batch, tiny_lm


CPU = torch.device("cpu")


def test_balanced_partition_respects_budget_and_balances() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(10, 200, (64,), generator=g)]
    bins = balanced_partition(lengths, max_tokens=600)
    assert sorted(i for b in bins for i in b) == list(range(64))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 600
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first keeps bins within one sample
    assert len(bins) <= -(-sum(lengths) // 600) + 2
    assert len(balanced_partition(lengths, 600, min_bins=len(bins) + 3)) == len(bins) + 3


def test_partition_edge_cases() -> None:
    assert balanced_partition([500, 10, 10], max_tokens=100) == [[0], [1, 2]]  # a long sample alone
    bins = balanced_partition([5, 5], max_tokens=100, min_bins=4)
    assert [b for b in bins if b] == [[0], [1]] and len(bins) == 4  # two empty bins: dummies


def test_micro_batches_restore_order() -> None:
    mb = make_batch(b=9)
    mbs = make_micro_batches(mb, 4, max_token_len=40)
    assert not any(mbs.dummy)
    stacked = torch.cat([p["input_ids"] for p in mbs.parts])
    assert torch.equal(mbs.restore(stacked), mb["input_ids"])


def test_dynamic_log_probs_equal_fixed_count() -> None:
    model, batch = tiny_lm(), make_batch(b=10, seed=1)
    mask = batch["response_mask"].bool()
    ref, ref_ent = batched_log_probs(model, batch, CPU, 1.0, 3, with_entropy=True)
    for budget in (30, 64, 1000):
        lp, ent = batched_log_probs(model, batch, CPU, 1.0, 3, True, ForwardOptions(max_token_len=budget))
        assert ent is not None and ref_ent is not None
        torch.testing.assert_close(lp[mask], ref[mask], atol=1e-6, rtol=0)
        torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------ FSDP2 over gloo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Any, world: int, *args: Any) -> None:
    """Run `fn(rank, world, *args)` in `world` spawned processes forming a gloo process group."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    mp.spawn(fn, args=(world, *args), nprocs=world, join=True)


def init_rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def close_rank() -> None:
    """Leave the gloo group together: without the barrier, a rank that destroys its group (and exits) while the other
    still reads from its pairs can take gloo's threads down mid-read (`terminate called without an active exception`,
    SIGABRT; seen once in CI under load)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _loss_fn(model: torch.nn.Module) -> Any:
    from easyrl.workers.forward_backward import MicroBatchLoss, token_log_probs

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        lp, _ = token_log_probs(model, mb, CPU, 1.0, False)
        mask = on_device["response_mask"].float()
        loss = -(lp * on_device["advantages"] * mask).sum() / mask.sum().clamp(min=1)
        return MicroBatchLoss(loss, {"actor/pg_loss": loss.detach()}, {})

    return loss_fn


def _optimize_worker(rank: int, world: int, model_dir: str, out: str, uneven: bool) -> None:

    from easyrl.config import FSDPConfig, ModelConfig, OptimConfig
    from easyrl.workers.forward_backward import optimize
    from easyrl.workers.model_setup import build_scheduler, iter_full_weights, load_model, shard_model

    init_rank(rank, world)
    # uneven: rank 0 holds 2 short samples, rank 1 eight long ones -> rank 0 runs dummy micro-batches
    batch = make_batch(b=2 if uneven and rank == 0 else 8, p=16, r=12, seed=10 + rank)
    results = {}
    for budget in [None, 40] if not uneven else [40]:
        model = shard_model(load_model(ModelConfig(model_path=model_dir)), FSDPConfig(), CPU)
        model.train()
        # SGD: Adam's first step is ~lr * sign(grad), which turns 1e-9 rounding noise in near-zero gradients
        # into lr-sized differences; SGD shows the gradients themselves are equal.
        optim = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = build_scheduler(optim, OptimConfig(), 10)
        kw = {"mini_batch_size": len(batch), "micro_batch_size": 3, "epochs": 1, "max_grad_norm": 1e9, "device": CPU}
        metrics = optimize(
            model, optim, sched, batch, loss_fn=_loss_fn(model), prefix="actor", max_token_len=budget, **kw
        )
        assert metrics["actor/skipped_updates"] == 0
        results[str(budget)] = {n: t.tolist() for n, t in iter_full_weights(model)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    close_rank()


@pytest.mark.parametrize("world", [1, 2])
def test_dynamic_update_equals_fixed_count(tmp_path, tiny_model_dir, world) -> None:
    out = tmp_path / "w.json"
    run_ranks(_optimize_worker, world, tiny_model_dir, str(out), False)
    res = json.loads(out.read_text())
    for name in res["None"]:
        torch.testing.assert_close(
            torch.tensor(res["40"][name]), torch.tensor(res["None"][name]), atol=1e-6, rtol=0, msg=name
        )


def test_dynamic_update_with_dummy_micro_batches(tmp_path, tiny_model_dir) -> None:
    """Ranks with different micro-batch counts stay in step (no hang) and give finite weights."""
    out = tmp_path / "w.json"
    run_ranks(_optimize_worker, 2, tiny_model_dir, str(out), True)
    weights = json.loads(out.read_text())["40"]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in weights.values())


def test_adamw_bf16_states() -> None:
    from easyrl.config import OptimConfig
    from easyrl.workers.model_setup import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    ref = torch.nn.Linear(16, 8)
    ref.load_state_dict(model.state_dict())
    opt = build_optimizer(model, OptimConfig(strategy="adamw_bf16", lr=1e-2))
    ref_opt = build_optimizer(ref, OptimConfig(strategy="adamw", lr=1e-2))
    for _ in range(3):
        x = torch.randn(4, 16)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    state = opt.state[model.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32  # master weights stay fp32
    torch.testing.assert_close(model.weight, ref.weight, atol=2e-3, rtol=0)


@pytest.mark.slow
def test_dynamic_batching_two_workers_end_to_end(ray_session, tmp_path, tiny_model_dir, digits_data) -> None:
    """The real trainer (Ray, 2 FSDP2 workers, GAE so the critic runs too) with dynamic batching, padding-free
    packing and the fused head all on. It is `make test`'s text GAE run (test_e2e.py's GAE case is `extended`)."""
    from tests.trainer.test_e2e import assert_finite, run

    edits = {
        "worker.actor.dynamic_batching": True,
        "worker.actor.max_token_len_per_gpu": 64,
        "worker.actor.padding_free": True,
        "worker.actor.fused_logprobs": True,
        "worker.actor.logprob_chunk_size": 5,
        "algorithm.adv_estimator": "gae",
        "algorithm.disable_kl": False,
        "algorithm.use_kl_loss": True,
        "worker.critic.global_batch_size": 2,
        "worker.critic.micro_batch_size_per_device_for_update": 2,
    }
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=2)
    assert len(rows) == 2
    assert_finite(rows)
    assert "actor/kl_loss" in rows[-1] and "critic/vf_loss" in rows[-1] and "actor/pg_loss" in rows[-1]
    assert "critic/values/mean" in rows[-1]  # the GAE run of tests/trainer/test_e2e.py's (extended) checks


@pytest.mark.slow
def test_benchmark_script_tiny_runs(ray_session, tmp_path) -> None:
    """`scripts/benchmark.py --tiny` runs the real trainer end to end on CPU and prints its summary."""
    from tests.conftest import run_script_in_process

    run_script_in_process("benchmark.py", "--tiny", "--steps", "1", "--warmup", "0", workdir=tmp_path)
    summary = json.loads(next(tmp_path.glob("run_tiny_*/summary.json")).read_text())
    assert summary["perf/throughput"][0] > 0 and summary["gen_tokens_per_s"][0] > 0
