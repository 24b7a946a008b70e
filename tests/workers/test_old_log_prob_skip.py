"""Skipping the old-log-prob pass (one epoch over one mini-batch) changes nothing: the update that takes its own
forward's log-probs, detached, as the old ones moves the parameters as the update given the old pass's log-probs,
and measures the engine against the trainer (`rollout/token_prob_error`, `rollout/logprob_diff_*`) as the driver
does against the pass. A tiny Qwen2 in one process, the actor's real objective (PPO clip, KL loss), padded and packed
rows."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.conftest import padded_rows, ppo_kl_loss


CPU = torch.device("cpu")
PROMPT, RESPONSES = 4, [1, 3, 6, 2, 5, 4]
LOSS = ppo_kl_loss()


def _batch(vocab: int = 90) -> Batch:
    g = torch.Generator().manual_seed(0)
    b, r = len(RESPONSES), max(RESPONSES)
    return Batch(
        {
            **padded_rows(PROMPT, RESPONSES, g, vocab=vocab),
            "advantages": torch.randn(b, r, generator=g),
            "ref_log_probs": -3.0 + 0.1 * torch.randn(b, r, generator=g),
        }
    )


def _update(
    model_dir: str,
    batch: Batch,
    opts: ForwardOptions,
    old_pass: bool,
    mini_batch: int | None = None,
    entropy_metric: bool = False,
) -> dict[str, Any]:
    """The actor's update (AdamW, 2 micro-batches a mini-batch of `mini_batch` rows, default all) after an
    old-log-prob pass or without one: the parameters before and after it, its metrics, and the batch it trained on
    (with the pass's log-probs when it ran). A batch that brings `old_log_probs` of its own is bypass mode: no pass.
    `entropy_metric`: the forward also gives the entropy, detached, with no bonus (what the actor's update does)."""
    from easyrl.config import ModelConfig, OptimConfig
    from easyrl.workers.actor import policy_objective
    from easyrl.workers.forward_backward import MicroBatchLoss, batched_log_probs, optimize, token_log_probs
    from easyrl.workers.model_setup import build_scheduler, load_model
    from easyrl.workers.varlen import register_varlen_attention

    attn = register_varlen_attention() if opts.padding_free else None
    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=attn)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    bypass = "old_log_probs" in batch
    if old_pass and not bypass:  # what `ActorWorker.compute_log_probs` does: eval mode, no grad
        model.eval()
        old, _ = batched_log_probs(model, batch, CPU, 1.0, micro_batch_size=4, opts=opts)
        batch = batch.union(Batch({"old_log_probs": old}))
    model.train()

    loss = dataclasses.replace(LOSS, measures_engine=bypass or not old_pass)  # as role_specs resolves it

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        lp, ent = token_log_probs(model, mb, CPU, 1.0, entropy_metric, opts=opts, entropy_grad=False)
        assert ent is None or not ent.requires_grad
        return policy_objective(on_device, lp, ent, loss, "token-mean", 0.0)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    metrics = optimize(
        model, optim, build_scheduler(optim, OptimConfig(lr=1e-3), 2), batch, device=CPU,
        mini_batch_size=mini_batch or len(batch),
        micro_batch_size=3, epochs=1, max_grad_norm=1.0, loss_fn=loss_fn, prefix="actor",
    )  # fmt: skip
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"before": before, "after": after, "metrics": metrics, "batch": batch}


@pytest.mark.parametrize("opts", [ForwardOptions(), ForwardOptions(padding_free=True)], ids=["padded", "packed"])
def test_update_without_old_log_probs_moves_the_parameters_alike(tiny_model_dir: str, opts: ForwardOptions) -> None:
    run = _update(tiny_model_dir, _batch(), opts, old_pass=True)
    before, with_pass = run["before"], run["after"]
    skipped = _update(tiny_model_dir, _batch(), opts, old_pass=False)["after"]
    assert (with_pass - before).abs().max() > 1e-4  # the step moved the parameters (AdamW: about lr each)
    # Equal up to float rounding: the eval-mode pass and the training forward may sum in another order.
    torch.testing.assert_close(skipped, with_pass, rtol=1e-5, atol=1e-6)


# Per row, the engine's probability of each sampled token over the policy's; rows 1 and 4 get no engine log-probs.
SCALE = [1.1, 3.0, 1.0, 1.2, 3.0, 1.05]
SAMPLED = [True, False, True, True, False, True]


@pytest.mark.parametrize("opts", [ForwardOptions(), ForwardOptions(padding_free=True)], ids=["padded", "packed"])
def test_update_without_the_pass_measures_the_engine_as_the_driver_does_against_it(
    tiny_model_dir: str, opts: ForwardOptions
) -> None:
    from easyrl.trainer.step_math import logprob_consistency

    # the pass's log-probs, and an engine off from them by SCALE on the rows it gave log-probs for
    old = _update(tiny_model_dir, _batch(), opts, old_pass=True)["batch"]["old_log_probs"]
    engine = {
        "rollout_log_probs": old + torch.tensor(SCALE).log().unsqueeze(1),
        "rollout_logprob_mask": torch.tensor(SAMPLED),
    }
    with_pass = _update(tiny_model_dir, _batch().union(Batch(engine)), opts, old_pass=True)
    skipped = _update(tiny_model_dir, _batch().union(Batch(engine)), opts, old_pass=False)
    driver = logprob_consistency(with_pass["batch"])  # what the trainer logs when the pass ran
    assert not any(k.startswith("rollout/") for k in with_pass["metrics"])  # the driver measured it: not twice
    # rows 0, 2, 3, 5 hold 1 + 6 + 2 + 4 response tokens off by 1.1, 1.0, 1.2, 1.05
    assert driver["rollout/token_prob_error"] == pytest.approx((1.1 + 6 + 2 * 1.2 + 4 * 1.05) / 13, rel=1e-6)
    assert driver["rollout/logprob_diff_max"] == pytest.approx(math.log(1.2), rel=1e-5)
    for key, want in driver.items():  # the training forward against the eval-mode pass: float32 noise only
        assert skipped["metrics"][key] == pytest.approx(want, rel=1e-6, abs=1e-6), key


def test_bypass_mode_measures_the_engine_in_the_first_mini_batch_only(tiny_model_dir: str) -> None:
    """Bypass mode: the engine's log-probs are the old ones and no pass runs; the update's first mini-batch (the
    weights that sampled) measures the engine, the second (moved weights) adds nothing to the figures."""
    from easyrl.trainer.step_math import logprob_consistency

    opts = ForwardOptions(padding_free=True)
    policy = _update(tiny_model_dir, _batch(), opts, old_pass=True)["batch"]["old_log_probs"]
    engine = policy + torch.tensor(SCALE).log().unsqueeze(1)
    fields = {"rollout_log_probs": engine, "rollout_logprob_mask": torch.tensor(SAMPLED)}
    bypassed = _update(tiny_model_dir, _batch().union(Batch({**fields, "old_log_probs": engine})), opts, True, 3)
    # rows 0-2 are the first mini-batch: rows 0 and 2 scored (1 and 6 tokens off by 1.1 and 1.0)
    first = logprob_consistency(_batch().slice(0, 3).union(Batch({**fields, "old_log_probs": policy}).slice(0, 3)))
    assert first["rollout/token_prob_error"] == pytest.approx((1.1 + 6) / 7, rel=1e-6)
    for key, want in first.items():
        assert bypassed["metrics"][key] == pytest.approx(want, rel=1e-6, abs=1e-6), key


@pytest.mark.parametrize(
    "opts",
    [ForwardOptions(), ForwardOptions(padding_free=True), ForwardOptions(padding_free=True, fused=True, chunk_size=5)],
    ids=["padded", "packed", "packed_fused"],
)
def test_entropy_metric_is_the_pass_entropy_and_leaves_the_update_bit_identical(
    tiny_model_dir: str, opts: ForwardOptions
) -> None:
    """Without a bonus the update's forward still gives `actor/entropy`, detached: the update moves every parameter
    bit for bit as without it, and the figure is the token mean the old-log-prob pass's entropy gives
    (`actor/entropy_rollout` when the pass runs)."""
    from easyrl.algorithms import masked_mean
    from easyrl.config import ModelConfig
    from easyrl.workers.forward_backward import batched_log_probs
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.varlen import register_varlen_attention

    plain = _update(tiny_model_dir, _batch(), opts, old_pass=False)
    metric = _update(tiny_model_dir, _batch(), opts, old_pass=False, entropy_metric=True)
    assert torch.equal(metric["after"], plain["after"]) and (plain["after"] != plain["before"]).any()
    assert "actor/entropy" not in plain["metrics"]
    assert {k: v for k, v in metric["metrics"].items() if k != "actor/entropy"} == plain["metrics"]
    attn = register_varlen_attention() if opts.padding_free else None
    model = load_model(ModelConfig(model_path=tiny_model_dir), attn_implementation=attn).eval()
    _, ent = batched_log_probs(model, _batch(), CPU, 1.0, micro_batch_size=4, with_entropy=True, opts=opts)
    assert ent is not None
    want = float(masked_mean(ent, _batch()["loss_mask"].float()))
    assert math.isfinite(metric["metrics"]["actor/entropy"]) and want > 0
    assert metric["metrics"]["actor/entropy"] == pytest.approx(want, rel=1e-5)
