"""Generation beside training (`worker.rollout.placement: separate` with `trainer.max_staleness >= 1`): the carry-over
loop starts a call on the rollout workers before it hands a step over and collects it at the next step, so the
engines generate while the actor trains. On CPU through Ray: 2 gloo actor workers, 1 rollout worker of its own, the
HF engine and a tiny model; every trained row is checked against the staleness bound and against the engine calls
that made it, and the calls' wall-clock windows against the updates'."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from tests.rollout.test_carry_over import ASYNC_EDITS, _made_by_the_engine, _stable, _trainer


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
SEPARATE = {"worker.rollout.placement": "separate", "worker.rollout.n_gpus": 1}


def _calls_of(request: Batch, out: Batch) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """(prompt, tokens, log-probs, versions) of each row of an engine call."""
    calls = []
    for i in range(len(request)):
        n = int(out["response_mask"][i].sum())
        calls.append(
            (
                request["input_ids"][i][request["attention_mask"][i].bool()].tolist(),
                out["responses"][i, :n].tolist(),
                out["rollout_log_probs"][i, :n].tolist(),
                out["token_policy_version"][i, :n].tolist(),
            )
        )
    return calls


class _Recorded:
    """A call under way whose rows are recorded when collected (the real call: its result is passed on)."""

    def __init__(self, pending: Any, request: Batch, calls: list) -> None:
        self.pending, self.request, self.calls = pending, request, calls

    def result(self) -> tuple[Batch, dict[str, float]]:
        out, timing = self.pending.result()
        self.calls += _calls_of(self.request, out)
        return out, timing


def _recorded_run(path: Path, model: str, data: dict[str, str], edits: dict[str, Any]) -> tuple[list, list, list]:
    """5 steps with a rollout worker of its own, every engine call (in a step's session or beside an update) and
    every trained batch (with the policy version it trained) recorded: (calls, trained, logged rows)."""
    trainer = _trainer(path, model, data, edits, 5)
    engines, actor = trainer.workers.engines, trainer.actor
    calls: list[tuple[list[int], list[int], list[float], list[int]]] = []
    trained: list[tuple[int, Batch]] = []
    updates: list[tuple[float, float]] = []  # the driver's wall clock around each update
    generate, beside, update = engines.generate, engines.generate_beside, actor.update_actor

    def record_generate(request: Batch, params: Any) -> Batch:
        out = generate(request, params)
        calls.extend(_calls_of(request, out))
        return out

    def record_beside(request: Batch, params: Any) -> tuple[dict[str, float], _Recorded]:
        pushed, pending = beside(request, params)
        return pushed, _Recorded(pending, request, calls)

    def record_update(batch: Batch, entropy_coeff: float) -> dict[str, float]:
        trained.append((actor.policy_version(), batch))
        start = time.time()
        try:
            return update(batch, entropy_coeff)
        finally:
            updates.append((start, time.time()))

    engines.generate, engines.generate_beside, actor.update_actor = record_generate, record_beside, record_update
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    return calls, trained, rows


@pytest.fixture(scope="module")
def s1_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, digits_data: dict[str, str]) -> tuple:
    """The recorded run at S = 1, saving every step: its folder, calls, trained batches and rows. The staleness
    test reads its records; the resume test resumes from its step-1 checkpoint (one run serves both)."""
    path = tmp_path_factory.mktemp("s1_run")
    edits = {**ASYNC_EDITS, **SEPARATE, "trainer.max_staleness": 1, "trainer.save_freq": 1}
    return (path, *_recorded_run(path, tiny_model_dir, digits_data, edits))


@pytest.mark.parametrize("staleness", [1, 2])
def test_rollout_workers_generate_while_the_actor_trains_within_the_staleness_bound(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], staleness: int
) -> None:
    if staleness == 1:
        _, calls, trained, rows = request.getfixturevalue("s1_run")
    else:
        edits = {**ASYNC_EDITS, **SEPARATE, "trainer.max_staleness": staleness}
        calls, trained, rows = _recorded_run(tmp_path, tiny_model_dir, digits_data, edits)
    assert len(trained) == 5
    spans = 0
    for version, batch in trained:
        mask = batch["loss_mask"].bool()
        ages = version - batch["token_policy_version"]
        assert int(ages[mask].max()) <= staleness and int(ages[mask].min()) >= 0, (version, ages)
        oldest = torch.where(mask, batch["token_policy_version"], 1 << 40).amin(dim=1)
        assert torch.equal(batch["policy_version"], oldest)
        for i in range(len(batch)):
            prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()].tolist()
            n = int(mask[i].sum())
            tokens = batch["token_policy_version"][i, :n].tolist()
            # every piece is what one engine call returned (in a step's session or beside the update)
            _made_by_the_engine(
                prompt, batch["responses"][i, :n].tolist(), batch["rollout_log_probs"][i, :n].tolist(), tokens, calls
            )
            spans += len(set(tokens)) > 1
    assert spans > 0, "no response resumed with newer weights after a call beside the update"
    assert max(r["async/staleness_max"] for r in rows) <= staleness
    beside = [r for r in rows if "async/beside_calls" in r]
    assert beside, "no call ran beside the training"
    # each call generated while the driver was away from the rollout (scoring, the passes, the update)
    assert all(r["async/overlap_s"] > 0 for r in beside)
    assert all(r["async/beside_tokens"] > 0 for r in beside)


@pytest.mark.extended  # 80 steps; `make test` covers its parts in shorter runs (docstring)
def test_the_demo_learns_with_its_rollout_worker_generating_during_the_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/demo.yaml, separate rollout worker, S = 1 (80 steps): the reward rises as in the synchronous demo, no
    trained token is more than one version old (checked on every trained row), and calls started beside an update
    ran during it: their windows (the rollout worker's wall clock) intersect the update's (the driver's).

    In `make test-extended` only (45 s of CI's `make test`): `make test` checks learning at S = 1 with
    tests/rollout/test_carry_over.py::test_the_demo_learns_with_one_step_of_staleness, and the staleness bound and
    the calls beside the updates of a separate rollout worker with
    test_rollout_workers_generate_while_the_actor_trains_within_the_staleness_bound above."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)  # the demo's paths are relative to the repository
    overrides = [
        "trainer.max_staleness=1",
        "worker.rollout.placement=separate",
        "worker.rollout.n_gpus=1",
        f"trainer.save_checkpoint_path={tmp_path}",
        "trainer.logger=[file]",
        "trainer.val_freq=-1",
        "trainer.val_before_train=false",
    ]
    trainer = Trainer(*load_config_and_secrets(str(repo / "configs" / "demo.yaml"), overrides))
    actor, update = trainer.actor, trainer.actor.update_actor
    updates: list[tuple[float, float]] = []  # the driver's wall clock around each update

    def record_update(batch: Batch, entropy_coeff: float) -> dict[str, float]:
        mask = batch["loss_mask"].bool()
        ages = actor.policy_version() - batch["token_policy_version"]
        assert int(ages[mask].min()) >= 0 and int(ages[mask].max()) <= 1, ages
        start = time.time()
        try:
            return update(batch, entropy_coeff)
        finally:
            updates.append((start, time.time()))

    actor.update_actor = record_update
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
    rewards = [r["reward/overall"] for r in rows]
    assert len(rewards) == 80 and len(updates) == 80
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 0.3, rewards
    assert max(r["async/staleness_max"] for r in rows) == 1.0
    beside = [r for r in rows if "async/beside_calls" in r]
    assert beside and all(r["async/overlap_s"] > 0 for r in beside)
    # the call started at step k is logged with step k+1; how long it ran during step k's update
    during = [
        min(end, r["async/beside_end_time"]) - max(start, r["async/beside_start_time"])
        for r in beside
        for start, end in [updates[int(r["step"]) - 2]]
    ]
    assert max(during) > 0, "the rollout worker never generated during an update"


def test_a_resumed_run_continues_the_call_beside_the_update_to_the_bit(
    s1_run: tuple, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """S = 1, separate: resuming from the step-1 checkpoint (it collects the call started beside that step's update)
    gives the uninterrupted run's steps 2 to 5 to the bit, the call's tokens included. (Step 1 is the one that leaves
    responses unfinished for that call with these seeds.) The checkpoint is the uninterrupted run's own (`s1_run`,
    whose engine calls are recorded: the recording changes nothing it computes), as a run killed after step 1 leaves
    it; the resumed run starts in a fresh folder."""
    from tests.conftest import train_steps

    edits = {**ASYNC_EDITS, **SEPARATE, "trainer.max_staleness": 1, "trainer.save_freq": 1}
    full_path, _, _, full = s1_run
    checkpoint = full_path / "run" / "global_step_1"
    edits["trainer.load_checkpoint_path"] = str(checkpoint)
    resumed, _, _ = train_steps(tmp_path / "resumed", tiny_model_dir, digits_data, edits, steps=5)
    assert [r["step"] for r in resumed] == [2, 3, 4, 5]
    # wall-clock figures of the call beside the update
    volatile = ("async/beside_engine_s", "async/beside_wait_s", "async/beside_st", "async/beside_end", "async/overlap")

    def stable(rows: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in _stable(rows)]

    assert stable(resumed) == stable(full[1:]), "the resumed run left the uninterrupted curve"
    assert max(r["async/resumed_fraction"] for r in full) > 0
    # the checkpoint collected the call started beside step 1's update (its tokens are in the groups saved)
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    assert saved["state"]["rollout_loop"]["beside_metrics"]["async/beside_tokens"] > 0
    assert resumed[0]["async/beside_calls"] == 1.0
