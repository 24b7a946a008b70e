"""`worker.rollout.placement: separate`: rollout workers of their own (resident engines, fed the policy's weights
after each update) train exactly like the HybridEngine. On CPU: Ray, 2 actor workers over gloo and 1 rollout worker,
the HF engine, the tiny model and the digits task."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import metric_mismatches, train_steps


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")
SEPARATE = {"worker.rollout.placement": "separate", "worker.rollout.n_gpus": 1}


@pytest.fixture(scope="module")
def separate(ray_session, tmp_path_factory, tiny_model_dir: str, digits_data: dict[str, str]) -> tuple[list, dict]:
    """3 steps with a rollout worker of its own and the default weight transfer (broadcast): (rows, final weights),
    one run that both tests below compare against."""
    from easyrl.config import RolloutConfig

    assert RolloutConfig().weight_transfer == "broadcast"  # what the transfer test takes this run for
    rows, _, weights = train_steps(
        tmp_path_factory.mktemp("separate"), tiny_model_dir, digits_data, SEPARATE, steps=3, weights=True
    )
    assert weights is not None
    return rows, weights


def test_separate_rollout_workers_train_like_the_hybrid_engine(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], separate: tuple[list, dict]
) -> None:
    hybrid, _, hybrid_weights = train_steps(
        tmp_path / "hybrid", tiny_model_dir, digits_data, {}, steps=3, weights=True
    )
    separate_rows, weights = separate
    # One engine instead of two, and every sample seeded by its place in the whole batch: the same rollouts, so the
    # same training (up to float noise: the engine sees the prompts in one batch instead of two).
    stable = [
        [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows] for rows in (separate_rows, hybrid)
    ]
    bad = metric_mismatches(*stable)
    assert not bad, "\n".join(bad)
    assert [r["rollout/policy_version_max"] for r in separate_rows] == [0.0, 1.0, 2.0]
    # The weights moved to the rollout worker after each update, not before the first step (it loaded the checkpoint).
    assert ["timing_s/weight_transfer" in r for r in separate_rows] == [False, True, True]
    assert all(r["perf/weight_transfer_gb"] > 0 for r in separate_rows[1:])
    assert "timing_s/sleep" not in separate_rows[0]  # a resident engine never sleeps
    assert hybrid_weights is not None
    for name, tensor in hybrid_weights.items():
        assert (weights[name] - tensor).abs().max() < 1e-5, name


def test_broadcast_and_driver_transfers_train_alike(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], separate: tuple[list, dict]
) -> None:
    """`weight_transfer: broadcast` (the default: a gloo group of its own between the policy's rank 0 and the
    rollout worker) and `driver` (through Ray's object store) deliver the same bytes: the same rollouts, the same
    training, the same bytes counted. The broadcast run is the module's `separate` run (broadcast is the default)."""
    broadcast = separate[0]
    edits = {**SEPARATE, "worker.rollout.weight_transfer": "driver"}
    driver, _, _ = train_steps(tmp_path / "driver", tiny_model_dir, digits_data, edits, steps=3)
    stable = [
        [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows] for rows in (broadcast, driver)
    ]
    assert stable[0] == stable[1]  # bit for bit: one process layout, the same weights in the engine
    assert [r.get("perf/weight_transfer_gb") for r in broadcast] == [r.get("perf/weight_transfer_gb") for r in driver]
    assert all(r["perf/weight_transfer_gb"] > 0 for r in broadcast[1:])
