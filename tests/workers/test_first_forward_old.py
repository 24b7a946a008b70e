"""Mini-batch 1's old log-probs from the update's own first forward (`worker.actor.reuse_first_forward`): the real
`ActorWorker` in one process, trained on one batch after a whole old-log-prob pass and with the pass inside the update
over the other rows only. Same parameters bit for bit (and the same metrics) where the pass's micro-batches are the
update's, within float noise otherwise; the figures the driver measures against a whole pass come from the update."""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.algorithms import masked_mean
from easyrl.batch import Batch
from easyrl.config import load_config
from easyrl.trainer.plan import plan_of
from easyrl.trainer.role_specs import build_role_specs
from easyrl.trainer.step_math import OldPass, logprob_consistency
from tests.conftest import apply_edits, base_config, padded_rows, write_config


RESPONSES = [3, 6, 2, 5, 8, 1, 4, 7]  # 4 prompts x n=2 rows; padded to width 8
SAMPLED = [True, False, True, True, False, True, True, True]  # rows the engine gave log-probs for


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch):
    """This process as a world of one worker (the env Ray's worker group would set)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # An in-process vLLM engine of an earlier test may own the default group (vLLM keeps its world group in a
    # global): destroying that one would break the next engine of this process. Only the group this test made goes.
    ours = not dist.is_initialized()
    yield
    if ours and dist.is_initialized():
        dist.destroy_process_group()


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    rows = padded_rows(4, RESPONSES, g, width=8, vocab=90)
    b, r = len(RESPONSES), 8
    # an engine a little off the policy (its log-probs are compared, never trained on)
    engine = -2.0 + 0.3 * torch.randn(b, r, generator=g)
    return Batch(
        {
            **rows,
            "advantages": torch.randn(b, r, generator=g),
            "rollout_log_probs": engine,
            "rollout_logprob_mask": torch.tensor(SAMPLED),
        }
    )


def _actor(tmp_path: Path, model_dir: str, data: dict[str, str], reuse: bool, edits: dict[str, Any]) -> Any:
    from easyrl.workers.actor import ActorWorker

    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = base_config(model_dir, data, tmp_path / "ckpt")
    raw["trainer"]["n_gpus_per_node"] = 1
    raw = apply_edits(raw, {"worker.actor.reuse_first_forward": reuse, **edits})
    cfg = load_config(write_config(tmp_path / f"cfg_{reuse}.yaml", raw), [])
    plan = plan_of(cfg)
    want = OldPass.AFTER_FIRST_MINI_BATCH if reuse else OldPass.ALL_ROWS
    assert plan.old_log_prob_pass is want
    actor = ActorWorker(build_role_specs(cfg, plan, optimizer_steps=8, world_size=1).actor)
    actor.init_model()
    return actor


def _driver_figures(batch: Batch) -> dict[str, float]:
    """What the trainer logs from a whole pass: the rollout entropy and the engine-vs-actor figures."""
    figures = logprob_consistency(batch)
    figures["actor/entropy_rollout"] = float(masked_mean(batch["entropys"], batch["loss_mask"].float()))
    return figures


def _no_grad_rows(actor: Any) -> list[int]:
    """Rows each forward of the policy ran without a graph (the old-log-prob pass's), recorded from now on."""
    rows: list[int] = []

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not torch.is_grad_enabled():
            rows.append(int(ids.shape[0]))

    actor.model.register_forward_pre_hook(count, with_kwargs=True)
    return rows


# (edits, whether the pass's micro-batches are the update's): 2 mini-batches; 2 epochs over them; 2 epochs over one
SAME = {"worker.actor.micro_batch_size_per_device_for_experience": 2}
CASES = {
    "two_mini_batches": ({"worker.actor.global_batch_size": 2, **SAME}, True),
    "two_epochs": ({"worker.actor.global_batch_size": 2, "worker.actor.ppo_epochs": 2, **SAME}, True),
    "one_mini_batch_two_epochs": ({"worker.actor.global_batch_size": 4, "worker.actor.ppo_epochs": 2, **SAME}, True),
    "other_micro_batches": ({"worker.actor.global_batch_size": 2}, False),  # the pass runs 4 rows a micro-batch
    # packed rows in token-budget micro-batches (rows permuted, then restored), 2 epochs: bins of other rows
    "packed_token_budget": (
        {
            "worker.actor.global_batch_size": 2,
            "worker.actor.ppo_epochs": 2,
            "worker.actor.padding_free": True,
            "worker.actor.dynamic_batching": True,
            "worker.actor.max_token_len_per_gpu": 24,
        },
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_with_mini_batch_1_from_its_first_forward_equals_the_update_after_a_whole_pass(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], single_process: None, case: str
) -> None:
    edits, same_micro_batches = CASES[case]
    full = _actor(tmp_path / "full", tiny_model_dir, digits_data, False, edits)
    batch = _batch()
    batch = batch.union(full.compute_log_probs(batch))  # the driver's `old` stage
    want = full.update_actor(batch, entropy_coeff=0.0)
    driver = _driver_figures(batch)
    want_weights = full.full_weights()

    reused = _actor(tmp_path / "reused", tiny_model_dir, digits_data, True, edits)
    before = reused.full_weights()
    no_grad_rows = _no_grad_rows(reused)
    got = reused.update_actor(_batch(), entropy_coeff=0.0)  # no pass before: the worker runs its part itself
    got_weights = reused.full_weights()
    mini = int(edits["worker.actor.global_batch_size"]) * 2  # prompts x n=2, one rank
    # mini-batch 1's rows never ran through the forward-only pass: only the rows after it, once (padded rows: a packed
    # micro-batch is one row of all its tokens)
    if not edits.get("worker.actor.padding_free"):
        assert sum(no_grad_rows) == len(RESPONSES) - mini, no_grad_rows
    else:
        assert no_grad_rows, "the forward-only pass over the rows after mini-batch 1 did not run"
    assert got["timing_s/old_in_update"] >= 0.0

    assert any(not torch.equal(before[k], got_weights[k]) for k in before), "the update moved no parameter"
    update_keys = {k for k in want if not k.startswith(("timing_s/", "perf/"))}
    assert update_keys <= set(got)
    if same_micro_batches:
        for name, value in want_weights.items():
            assert torch.equal(got_weights[name], value), name
        for key in update_keys:  # every metric the update logs, bit for bit
            assert got[key] == want[key] or (math.isnan(got[key]) and math.isnan(want[key])), key
    else:  # another grouping of rows in the matmuls: float32 rounding only
        for name, value in want_weights.items():
            torch.testing.assert_close(got_weights[name], value, rtol=1e-5, atol=1e-6)
        for key in update_keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # what the driver logs from a whole pass, now from the update: every row, float64 sums in another order
    assert set(driver) == {
        "actor/entropy_rollout",
        "rollout/logprob_diff_mean",
        "rollout/logprob_diff_max",
        "rollout/token_prob_error",
    }
    for key, value in driver.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert not any(k.startswith("rollout/") for k in want)  # the driver measured them: not twice
