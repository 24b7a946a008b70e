"""The optimizer step does not depend on the layout: one step of the actor's real objective (PPO loss, entropy bonus,
KL loss; and with `topk_fkl`'s forward-KL term) on a fixed batch whose rows have very unequal response lengths gives the same parameters at 1 rank, 2
data-parallel ranks, a Ulysses group of 2, and 2 data-parallel ranks with 3 uneven token-budget micro-batches each,
for token-mean and seq-mean-token-mean; the critic's step and value loss are the same at 1 and 2 ranks. The loss
metrics are the global values at every layout. FSDP2 over gloo, tiny Qwen2, padding-free rows.

Also: every tensor the actor's and the critic's objectives use comes from the micro-batch's one device transfer
(checked on the meta device, where a tensor from anywhere else fails to mix)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.conftest import padded_rows, ppo_kl_loss
from tests.workers.test_batching import close_rank, init_rank, run_ranks


CPU = torch.device("cpu")
WORLD = 2
PROMPT, RESPONSES = 4, [1, 2, 2, 3, 10, 10, 4, 2]
"""Rank 0's half of the batch has short responses, rank 1's long ones: per-rank token means weigh them wrongly."""
BUDGET = 15
"""Token budget that cuts rank 1's rows (14, 14, 8, 6 tokens) into 3 micro-batches of 1, 1 and 2 rows."""
LOSS = ppo_kl_loss()
LOSS_TOPK = dataclasses.replace(LOSS, distill_topk_coef=0.5)
"""The same objective plus `topk_fkl`'s forward KL over a teacher's top 3 tokens (unfused head: no Ulysses case)."""
ENTROPY_COEFF = 0.01
TOP_K = 3


def _batch(vocab: int = 90) -> Batch:
    g = torch.Generator().manual_seed(0)
    b, r = len(RESPONSES), max(RESPONSES)
    return Batch(
        {
            **padded_rows(PROMPT, RESPONSES, g, vocab=vocab),
            "advantages": torch.randn(b, r, generator=g),
            "returns": torch.randn(b, r, generator=g),
            "values": 0.1 * torch.randn(b, r, generator=g),
            # a teacher's top 3 of 4 tokens at each position, its log-probs of them
            "teacher_topk_ids": torch.randint(0, vocab, (b, r, TOP_K), generator=g),
            "teacher_topk_log_probs": torch.log_softmax(torch.randn(b, r, TOP_K + 1, generator=g), -1)[..., :TOP_K],
        }
    )


def _step(model_dir: str, batch: Batch, kind: str, agg: str, opts: ForwardOptions, micro: int) -> dict[str, Any]:
    """One optimizer step (SGD, lr 1: Adam's first step is ~lr * sign(grad) and would hide the gradients) of the
    actor's or the critic's real objective; the flattened full parameters after it, and the metrics."""
    import torch.distributed as dist

    from easyrl.config import FSDPConfig, ModelConfig, OptimConfig
    from easyrl.workers.actor import policy_objective
    from easyrl.workers.critic import value_objective
    from easyrl.workers.forward_backward import MicroBatchLoss, optimize, response_values, token_log_probs
    from easyrl.workers.head import token_log_probs_at
    from easyrl.workers.model_setup import build_scheduler, iter_full_weights, load_model, shard_model
    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    attn = register_varlen_attention()
    sp = enable_sequence_parallel(opts.ulysses_size, attn, opts.ring_size) if opts.sp_size > 1 else None
    attn = sp.attn_implementation if sp is not None else attn
    torch.manual_seed(0)  # the critic's value head is fresh: the same init at every layout
    role = "value" if kind == "critic" else "causal_lm"
    model = load_model(ModelConfig(model_path=model_dir), role, attn_implementation=attn)
    if sp is not None:
        sp.attach(model)
    if dist.is_initialized():
        model = shard_model(model, FSDPConfig(), CPU)
    model.train()

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        if kind == "critic":
            return value_objective(on_device, response_values(model, mb, CPU, opts), 0.5, agg)
        if kind == "actor_topk":
            lp, ent, at = token_log_probs_at(model, mb, CPU, 1.0, mb["teacher_topk_ids"], True, opts)
            return policy_objective(on_device, lp, ent, LOSS_TOPK, agg, ENTROPY_COEFF, at)
        lp, ent = token_log_probs(model, mb, CPU, 1.0, with_entropy=True, opts=opts)
        return policy_objective(on_device, lp, ent, LOSS, agg, ENTROPY_COEFF)

    before = torch.cat([t.reshape(-1) for _, t in iter_full_weights(model)])
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = optimize(
        model, optim, build_scheduler(optim, OptimConfig(), 10), batch, device=CPU, mini_batch_size=len(batch),
        micro_batch_size=micro, epochs=1, max_grad_norm=1e9, loss_fn=loss_fn, prefix=kind, loss_agg_mode=agg,
        max_token_len=opts.max_token_len, sp_size=opts.sp_size,
    )  # fmt: skip
    params = torch.cat([t.reshape(-1) for _, t in iter_full_weights(model)])
    return {"params": params, "change": float((params - before).abs().max()), "metrics": metrics}


def _with_old_log_probs(model_dir: str, batch: Batch) -> Batch:
    """The policy's own log-probs as the rollout's (ratio 1, nothing clipped: every token has gradient) and a
    reference a little off (a non-zero KL loss)."""
    from easyrl.config import ModelConfig
    from easyrl.workers.forward_backward import token_log_probs
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.varlen import register_varlen_attention

    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=register_varlen_attention())
    with torch.no_grad():
        old, _ = token_log_probs(model, batch, CPU, 1.0, False, ForwardOptions(padding_free=True))
    noise = 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    return batch.set(old_log_probs=old, ref_log_probs=old + noise)


CASES: list[tuple[str, str, str, ForwardOptions, int]] = [
    # (name, role, loss_agg_mode, forward options, micro-batch size)
    (f"{role} {agg} {name}", role, agg, opts, micro)
    for role, aggs in (
        ("actor", ("token-mean", "seq-mean-token-mean")),
        ("actor_topk", ("token-mean",)),
        ("critic", ("token-mean",)),
    )
    for agg in aggs
    for name, opts, micro in (
        ("dp2", ForwardOptions(padding_free=True), 4),
        ("sp2", ForwardOptions(padding_free=True, ulysses_size=2), 8),
        ("dp2-dynamic", ForwardOptions(padding_free=True, max_token_len=BUDGET), 8),
    )
    if role == "actor" or name == "dp2" or (role == "actor_topk" and name != "sp2")  # topk_fkl refuses Ulysses
]


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:

    torch.set_num_threads(1)
    batch = _with_old_log_probs(model_dir, _batch())
    # 1 rank: no process group, the whole batch (the reference every layout must reproduce)
    single = {(role, agg): _step(model_dir, batch, role, agg, ForwardOptions(padding_free=True), 8)
              for _, role, agg, _, _ in CASES}  # fmt: skip
    init_rank(rank, world)
    report: dict[str, Any] = {}
    for name, role, agg, opts, micro in CASES:
        sp = opts.sp_size
        rows = batch.chunk(world // sp)[rank // sp]  # DP_SPLIT: a sequence-parallel group shares its chunk
        got, want = _step(model_dir, rows, role, agg, opts, micro), single[(role, agg)]
        loss_key = "critic/vf_loss" if role == "critic" else "actor/pg_loss"
        report[name] = {
            "max_param_diff": float((got["params"] - want["params"]).abs().max()),
            "change": want["change"],
            "loss": [got["metrics"][loss_key], want["metrics"][loss_key]],
            "metrics_equal": all(
                abs(got["metrics"][k] - v) <= 1e-5 * max(1.0, abs(v))
                for k, v in want["metrics"].items()
                if not k.endswith("/lr")
            ),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    close_rank()


def test_one_step_is_the_same_at_every_layout(tmp_path: Path) -> None:
    from easyrl.testing.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    out = tmp_path / "report.json"
    run_ranks(_worker, WORLD, model_dir, str(out))
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(name for name, *_ in CASES)
    for name, r in report.items():
        assert r["change"] > 1e-3, (name, r)  # the step moved the parameters: a wrong weighting would show
        assert r["max_param_diff"] < 1e-6, (name, r)
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-6, (name, r)
        assert r["metrics_equal"], (name, r)


def test_objectives_read_only_the_transferred_micro_batch() -> None:
    """The actor's objective (PPO with truncated IS weights, entropy bonus, KL loss; without the pass, the engine's
    log-probs measured against its forward) and the critic's, given the micro-batch moved to the meta device, run on
    it end to end: a tensor from anywhere else (the driver's host tensors, a constant made on the host) would refuse
    to mix with meta ones, as a host tensor does on a GPU."""
    from easyrl.workers.actor import policy_objective
    from easyrl.workers.critic import value_objective

    batch = _batch()
    shape = batch["response_mask"].shape
    batch.set(old_log_probs=torch.randn(shape), ref_log_probs=torch.randn(shape), rollout_is_weights=torch.rand(shape))
    batch.set(rollout_log_probs=torch.randn(shape), rollout_logprob_mask=torch.rand(shape[0]) < 0.5)
    meta = torch.device("meta")
    on_device = batch.to(meta)
    no_pass = on_device.select(*(k for k in on_device.tensors if k != "old_log_probs"))
    assert all(t.device == meta for t in on_device.tensors.values())
    log_prob, entropy = torch.randn(shape, device=meta), torch.rand(shape, device=meta)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        at = torch.randn(*shape, TOP_K, device=meta)  # the student's log-probs at the teacher's top-k ids
        outs = [
            policy_objective(on_device, log_prob, entropy, LOSS, agg, ENTROPY_COEFF),
            policy_objective(on_device, log_prob, entropy, LOSS_TOPK, agg, ENTROPY_COEFF, at),
            value_objective(on_device, log_prob, 0.5, agg),
            policy_objective(no_pass, log_prob, entropy, LOSS, agg, ENTROPY_COEFF),
        ]
        assert outs[-1].ratios and outs[-1].maxima  # the engine-vs-actor figures' parts
        for out in outs:
            values = [out.loss, *out.terms.values(), *out.token_means.values(), *out.maxima.values()]
            values += [part for pair in out.ratios.values() for part in pair]
            assert all(isinstance(v, torch.Tensor) and v.device == meta for v in values), agg
    # the check is real: a host tensor among the inputs fails, as the IS weights did on a GPU run
    batch_with_host_weights = Batch({**on_device.tensors, "rollout_is_weights": torch.rand(shape)})
    with pytest.raises(RuntimeError, match="device"):
        policy_objective(batch_with_host_weights, log_prob, entropy, LOSS, "token-mean", ENTROPY_COEFF)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_actor_step_with_tis_weights_on_gpu(tmp_path: Path) -> None:
    """The GPU run that crashed: truncated IS weights made on the driver (host) in the batch, the loss on CUDA."""
    from easyrl.config import ModelConfig, OptimConfig
    from easyrl.testing.tiny import build_tiny_checkpoint
    from easyrl.workers.actor import policy_objective
    from easyrl.workers.forward_backward import MicroBatchLoss, optimize, token_log_probs
    from easyrl.workers.model_setup import build_scheduler, load_model

    cuda = torch.device("cuda")
    model_dir = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    model = load_model(ModelConfig(model_path=model_dir)).to(cuda).train()
    batch = _batch()
    shape = batch["response_mask"].shape
    batch.set(old_log_probs=-torch.rand(shape), ref_log_probs=-torch.rand(shape), rollout_is_weights=torch.rand(shape))

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        lp, ent = token_log_probs(model, mb, cuda, 1.0, with_entropy=True)
        return policy_objective(on_device, lp, ent, LOSS, "token-mean", ENTROPY_COEFF)

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = optimize(
        model, optim, build_scheduler(optim, OptimConfig(), 10), batch, device=cuda, mini_batch_size=8,
        micro_batch_size=3, epochs=1, max_grad_norm=1.0, loss_fn=loss_fn, prefix="actor",
    )  # fmt: skip
    assert metrics["actor/skipped_updates"] == 0 and "actor/pg_loss" in metrics


def test_a_non_finite_loss_skips_the_step() -> None:
    """The loss is read once per mini-batch now, not per micro-batch: a NaN in one micro-batch still skips that
    optimizer step, counted as a non-finite loss; a finite batch then steps."""
    from easyrl.config import OptimConfig
    from easyrl.workers.forward_backward import MicroBatchLoss, optimize, token_log_probs
    from easyrl.workers.model_setup import build_scheduler
    from tests.workers.test_packing import tiny_lm

    model = tiny_lm().train()
    batch = _batch(vocab=64)
    poisoned = batch["advantages"].clone()
    poisoned[1, 0] = float("nan")  # the first mini-batch's second micro-batch
    batch.set(advantages=poisoned)

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        lp, _ = token_log_probs(model, mb, CPU, 1.0, False)
        loss = -(lp * on_device["advantages"] * on_device["response_mask"]).sum()
        return MicroBatchLoss(loss, {"actor/pg_loss": loss.detach()}, {})

    before = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"mini_batch_size": 4, "micro_batch_size": 1, "epochs": 1, "max_grad_norm": 1.0, "device": CPU}
    metrics = optimize(
        model,
        optim,
        build_scheduler(optim, OptimConfig(), 10),
        batch.slice(0, 4),
        loss_fn=loss_fn,
        prefix="actor",
        **kw,
    )
    assert (metrics["actor/skipped_updates"], metrics["actor/nonfinite_loss"]) == (1.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    metrics = optimize(
        model,
        optim,
        build_scheduler(optim, OptimConfig(), 10),
        batch.slice(4, 8),
        loss_fn=loss_fn,
        prefix="actor",
        **kw,
    )
    assert metrics["actor/skipped_updates"] == 0.0 and "actor/grad_norm" in metrics
