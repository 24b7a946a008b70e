"""Self-healing engines in a training run (issue 45, item 8): the actor's engine fails in step 2's generation and is
restarted inside the step, which then trains on the rows a healthy engine gives: the run's whole trajectory is the
fault-free run's. Two actor ranks recover in place (an OOM in the HF decoding loop); one rank, whose engine is killed,
is rebuilt with the policy's current weights gathered again (`workers.actor.ResidentPolicy`)."""

from __future__ import annotations

import pytest

from easyrl.rollout.faults import FAULT_ENV, reset_fault_count
from tests.conftest import train_steps


pytestmark = pytest.mark.slow
_VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/engine_restarts")


SEPARATE = {"worker.rollout.placement": "separate", "worker.rollout.n_gpus": 1}
"""One rollout worker of its own: its engine is rebuilt from the weights the policy's bus sent it (on the host)."""


def run(tmp_path, model: str, data: dict[str, str], workers: int, edits: dict | None = None) -> list[dict[str, float]]:
    """Two training steps in a Ray instance of their own (its workers inherit this process's environment), or inline."""
    import ray

    # Inline (one worker per role) the engine runs in this process, whose call count earlier runs advanced: from 1 again
    reset_fault_count()
    ray.shutdown()
    try:
        rows, _, _ = train_steps(tmp_path, model, data, {"trainer.n_gpus_per_node": workers, **(edits or {})}, steps=2)
    finally:
        ray.shutdown()
    return rows


@pytest.mark.parametrize(
    ("workers", "edits", "fault", "restarts"),
    [(2, {}, "oom@2", 2.0), (1, {}, "kill@2", 1.0), (1, SEPARATE, "kill@2", 1.0)],
    ids=["two-ranks-oom", "one-rank-killed", "separate-killed"],
)
def test_a_failed_engine_finishes_the_step_as_if_healthy(
    workers: int, edits: dict, fault: str, restarts: float, tmp_path, tiny_model_dir, digits_data, monkeypatch
) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    healthy = run(tmp_path / "healthy", tiny_model_dir, digits_data, workers, edits)
    monkeypatch.setenv(FAULT_ENV, fault)  # each engine process's second generate call: step 2's
    healed = run(tmp_path / "healed", tiny_model_dir, digits_data, workers, edits)
    assert [r["rollout/engine_restarts"] for r in healthy] == [0.0, 0.0]
    assert [r["rollout/engine_restarts"] for r in healed] == [0.0, restarts]  # every engine restarted once
    stable = [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in healthy]
    assert stable == [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in healed]


def test_a_second_failure_in_the_step_stops_the_run_with_one_line(
    tmp_path, tiny_model_dir, digits_data, monkeypatch
) -> None:
    """Step 2's call fails, and so does its re-send: the run stops, and the driver's error is the engine's one line
    (no remote traceback) under the worker's header."""
    from easyrl.distributed.errors import WorkerError

    monkeypatch.setenv(FAULT_ENV, "oom@2,3")
    with pytest.raises(WorkerError) as err:
        run(tmp_path, tiny_model_dir, digits_data, workers=1)
    header, line = str(err.value).splitlines()
    assert header == "the actor worker of rank 0 raised an exception:"
    assert line.startswith("EngineFailedError: rollout engine 'hf' of rank 0 failed again after its restart")
    assert "engine session 2" in line and "first error: OutOfMemoryError: injected" in line
