"""One GRPO step on 2 Ray workers with `ulysses_size` 2, and with `ring_size` 2 (ring attention), equals the same step
without the split: the same rollouts, rewards, gradient norm and updated weights. (The reference runs the same forward with the actor's options
(tests/config/test_sequence_parallel.py) and was checked this way too; left out here, its two extra workers per run
double the test's time.)

Why the two runs can agree exactly: both have 2 rollout engines (the same samples); without the split each worker
updates on half the batch and FSDP averages the two gradients, with it both workers hold the whole batch. With one
optimizer step per training step and `seq-mean-token-mean` (each sample weighs 1/batch either way), both are the
gradient of the same loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


def test_grpo_step_with_ulysses_or_ring_equals_without(tmp_path: Path, tiny_model_dir: str, digits_data) -> None:
    edits = {
        "worker.actor.padding_free": True,
        "worker.actor.fused_logprobs": True,
        "worker.actor.dynamic_batching": True,
        "worker.actor.max_token_len_per_gpu": 96,
        "worker.actor.global_batch_size": 4,  # one optimizer step over the whole batch
        "worker.actor.loss_avg_mode": "seq-mean-token-mean",
    }
    rows: dict[str, dict] = {}
    weights: dict[str, dict] = {}
    for name, split in (
        ("none", {}),
        ("ulysses", {"worker.actor.ulysses_size": 2}),
        ("ring", {"worker.actor.ring_size": 2}),
    ):
        logged, before, after = run(tmp_path / name, tiny_model_dir, digits_data, {**edits, **split}, 1, True)
        assert before is not None and after is not None
        rows[name], weights[name] = logged[0], after
    # one mini-batch per step: the old-log-prob pass is skipped (no actor/entropy_rollout); pg_loss is a global figure,
    # and so is the engine-vs-actor figure the update's forward measures (float32 noise here: 1 + ~1e-7)
    keys = ("reward/overall", "response_length/mean", "actor/grad_norm", "actor/pg_loss", "rollout/token_prob_error")
    for split in ("ulysses", "ring"):
        for key in keys:
            assert rows[split][key] == pytest.approx(rows["none"][key], rel=1e-4, abs=1e-6), (split, key)
        for name, tensor in weights["none"].items():
            torch.testing.assert_close(weights[split][name], tensor, atol=1e-5, rtol=1e-4, msg=f"{split} {name}")
    assert not all(torch.equal(weights["none"][n], before[n]) for n in before)  # the step did move the weights
