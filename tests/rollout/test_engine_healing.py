"""Self-healing engines (issue 45, item 8): a rollout engine that fails inside `generate` is restarted once per engine
session, in place or rebuilt with the current weights pushed again, and its call re-sent; the rows are the ones a
healthy engine gives. A second failure in the session stops the run with one line.

The failures are real ones of the real engines, injected by `EASYRL_ENGINE_FAULT` (`easyrl.rollout.faults`): an OOM
raised from the HF engine's decoding loop, the HF model dropped, vLLM's engine core losing its worker under its
requests."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.distributed.memory import MemoryLedger
from easyrl.rollout.engine import EngineFailedError, SamplingParams
from easyrl.rollout.faults import FAULT_ENV, next_fault, parse_fault, reset_fault_count
from easyrl.rollout.worker import RolloutWorker
from easyrl.seeding import SEED_COLUMN, prompt_seeds
from easyrl.trainer.plan import plan_of
from easyrl.trainer.role_specs import rollout_spec
from easyrl.workers.rollout_role import ReceivedWeights


HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ["Copy: 1 2 3", "Reverse: 4 5", "Copy: 9"]
PARAMS = SamplingParams(n=2, temperature=0.9, max_tokens=8)
FIELDS = ("responses", "response_mask", "rollout_log_probs", "input_ids", "policy_version")


@pytest.fixture(autouse=True)
def fault_count(monkeypatch: pytest.MonkeyPatch):
    """Every test counts engine calls from 1 and leaves no fault behind."""
    monkeypatch.delenv(FAULT_ENV, raising=False)
    reset_fault_count()
    yield
    reset_fault_count()


def prompts_of(tokenizer) -> Batch:
    """The prompts left-padded, each with its seed as the driver attaches it."""
    rows = [tokenizer.encode(t) for t in PROMPTS]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    seeds = prompt_seeds(11, len(rows), PARAMS.n)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions, SEED_COLUMN: seeds})


def make_worker(model_dir: str, engine: str) -> RolloutWorker:
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = cfg.worker.actor.model.tokenizer_path = model_dir
    cfg.worker.rollout.name = engine
    cfg.worker.rollout.logprob_sample_ratio = 1.0
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, PARAMS.max_tokens
    device = torch.device("cpu")
    return RolloutWorker(rollout_spec(cfg, plan_of(cfg)), device, MemoryLedger("rollout", device), sleeps=False)


def moved_policy(model_dir: str) -> ReceivedWeights:
    """Weights other than the checkpoint's (a policy a few updates on), every name with its tied aliases."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    weights = {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    return ReceivedWeights(weights, merged_lora=False)


def session(worker: RolloutWorker, prompts: Batch, source: ReceivedWeights | None, calls: int = 1):
    """One engine session: push `source` (policy version 1) when given, `calls` generate calls, close."""
    if source is not None:
        worker.stale = True
        worker.rebuild_source = source
    worker.open(source or ReceivedWeights({}, merged_lora=False), 1 if source else 0, make_room=lambda: None)
    rows = [worker.generate(prompts, PARAMS) for _ in range(calls)]
    return rows, worker.close()


def assert_same_rows(got: Batch, want: Batch) -> None:
    for field in FIELDS:
        assert torch.equal(got[field], want[field]), f"{field} differs from the healthy engine's"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def healthy_rows(tiny_model_dir: str, tokenizer) -> dict[str, Batch]:
    """What a healthy HF engine gives for the prompts: with the checkpoint, and with the moved policy."""
    worker = make_worker(tiny_model_dir, "hf")
    prompts = prompts_of(tokenizer)
    (checkpoint,), _ = session(worker, prompts, None)
    (moved,), _ = session(worker, prompts, moved_policy(tiny_model_dir))
    assert not torch.equal(checkpoint["responses"], moved["responses"]), "the moved policy must sample otherwise"
    return {"checkpoint": checkpoint, "moved": moved}


def test_an_oom_mid_generation_recovers_in_place(tiny_model_dir, tokenizer, healthy_rows, monkeypatch) -> None:
    worker = make_worker(tiny_model_dir, "hf")
    engine = worker.engine
    monkeypatch.setenv(FAULT_ENV, "oom@1")
    (rows,), timing = session(worker, prompts_of(tokenizer), None)
    assert worker.engine is engine, "an OOM leaves the weights intact: no rebuild"
    assert timing["rollout/engine_restarts"] == 1.0
    assert_same_rows(rows, healthy_rows["checkpoint"])


def test_a_dead_engine_is_rebuilt_with_the_current_weights(
    tiny_model_dir, tokenizer, healthy_rows, monkeypatch
) -> None:
    worker = make_worker(tiny_model_dir, "hf")
    engine = worker.engine
    monkeypatch.setenv(FAULT_ENV, "kill@1")
    (rows,), timing = session(worker, prompts_of(tokenizer), moved_policy(tiny_model_dir))
    assert worker.engine is not engine, "a killed engine is rebuilt"
    assert timing["rollout/engine_restarts"] == 1.0
    # the rebuilt engine loaded the checkpoint; the moved policy pushed again gives the moved policy's rows
    assert_same_rows(rows, healthy_rows["moved"])
    assert rows["policy_version"].tolist() == [1] * len(rows)


def test_restarts_count_per_session(tiny_model_dir, tokenizer, monkeypatch) -> None:
    """Calls 1 and 4 fail, in sessions 1 and 3 (call 2 is the re-send, 3 is session 2's): each is restarted."""
    worker = make_worker(tiny_model_dir, "hf")
    prompts = prompts_of(tokenizer)
    monkeypatch.setenv(FAULT_ENV, "raise@1,4")
    restarts = [session(worker, prompts, None)[1]["rollout/engine_restarts"] for _ in range(3)]
    assert restarts == [1.0, 0.0, 1.0]


def test_a_second_failure_in_the_session_stops_with_one_line(tiny_model_dir, tokenizer, monkeypatch) -> None:
    worker = make_worker(tiny_model_dir, "hf")
    monkeypatch.setenv(FAULT_ENV, "oom@1,2")  # the call, then its re-send
    with pytest.raises(EngineFailedError) as err:
        session(worker, prompts_of(tokenizer), None)
    line = str(err.value)
    assert "\n" not in line
    assert "rollout engine 'hf' of rank 0 failed again after its restart" in line
    assert "engine session 1" in line and "first error: OutOfMemoryError: injected" in line


def test_a_failure_in_a_later_call_of_the_session_stops_the_run(tiny_model_dir, tokenizer, monkeypatch) -> None:
    """Restarted once at call 1 (re-sent as call 2); the session's next call (3) fails: no second restart."""
    worker = make_worker(tiny_model_dir, "hf")
    monkeypatch.setenv(FAULT_ENV, "raise@1,3")
    with pytest.raises(EngineFailedError, match="first error: InjectedEngineFault"):
        session(worker, prompts_of(tokenizer), None, calls=2)


def test_a_rebuild_without_a_local_weight_source_stops_with_one_line(tiny_model_dir, tokenizer, monkeypatch) -> None:
    """Pushed weights that this process cannot read alone (a multi-rank actor's shards): the rebuilt engine would
    serve the checkpoint instead of the policy, so the run stops rather than sampling from the wrong weights."""
    worker = make_worker(tiny_model_dir, "hf")
    prompts = prompts_of(tokenizer)
    session(worker, prompts, moved_policy(tiny_model_dir))
    worker.rebuild_source = None
    monkeypatch.setenv(FAULT_ENV, "kill@1")
    with pytest.raises(EngineFailedError, match="cannot be read by this process alone") as err:
        session(worker, prompts, None)
    assert "first error: " in str(err.value) and "policy version 1" in str(err.value)


def test_fault_spec_is_checked() -> None:
    assert parse_fault("kill@2,4") == ("kill", {2, 4})
    for bad in ("kill", "boom@1", "oom@0", "oom@x"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}=.*expected <kind>@<call>"):
            parse_fault(bad)


def test_no_fault_without_the_variable() -> None:
    assert [next_fault() for _ in range(3)] == [None, None, None]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_engine_core_killed_or_failing_in_a_step_is_rebuilt(tiny_model_dir, tokenizer, monkeypatch) -> None:
    """The engine core loses its worker (weights, KV cache) under the call's requests: the probe fails, the engine is
    rebuilt from its spec in this process, the moved policy pushed again, and the call re-sent gives the rows a
    healthy engine with those weights gives. Then an OOM inside a step: rebuilt again, same rows."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    worker = make_worker(tiny_model_dir, "vllm")
    prompts, policy = prompts_of(tokenizer), moved_policy(tiny_model_dir)
    (healthy,), _ = session(worker, prompts, policy)
    engine = worker.engine
    monkeypatch.setenv(FAULT_ENV, "kill@1")
    reset_fault_count()
    (rows,), timing = session(worker, prompts, policy)
    assert worker.engine is not engine and timing["rollout/engine_restarts"] == 1.0
    assert_same_rows(rows, healthy)
    monkeypatch.delenv(FAULT_ENV)
    (after,), timing = session(worker, prompts, None)  # the rebuilt engine keeps serving the pushed policy
    assert timing["rollout/engine_restarts"] == 0.0
    assert_same_rows(after, healthy)
    # An OOM raised by the model's forward inside the core's step, the call's requests in flight: vLLM's scheduler
    # is not trusted after that (it hung when reused), so the engine is rebuilt again, the same rows re-sent.
    rebuilt = worker.engine
    monkeypatch.setenv(FAULT_ENV, "oom@1")
    reset_fault_count()
    (rows,), timing = session(worker, prompts, None)
    assert worker.engine is not rebuilt and timing["rollout/engine_restarts"] == 1.0
    assert_same_rows(rows, healthy)
