"""A reward model (a one-output sequence classifier, tiny, built from a config here) scored through a model
reference: locally, in reward worker processes, through a real vLLM pooling server, and inside a training run with
per-domain routing."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from easyrl.config.model_ref import ModelRefConfig, RewardModelConfig
from easyrl.config.worker import RewardConfig
from easyrl.scorers.reward_model import RewardModel
from tests.conftest import REPO, base_config, write_config


RM_REWARD = str(REPO / "reward_functions" / "judge.py") + ":reward_model_score"
SAMPLES = [
    {"prompt": "Copy: 1 2 3", "response": "123", "ground_truth": "123"},
    {"prompt": "Reverse: 4 5", "response": "54 and some more text", "ground_truth": "54"},
    {"prompt": "Copy: 9", "response": "", "ground_truth": "9"},
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from easyrl.testing.tiny import build_reward_model

    # two query heads and one KV head of size 32, as vLLM's CPU attention wants
    return build_reward_model(tmp_path_factory.mktemp("rm") / "qwen2_rm", seed=3, num_heads=2, num_kv_heads=1)


def reference_scores(rm_dir: str) -> list[float]:
    """Each sample alone (no padding) through the Hugging Face classifier, on its chat-templated (prompt, response)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    out = []
    for s in SAMPLES:
        turns = [{"role": "user", "content": s["prompt"]}, {"role": "assistant", "content": s["response"]}]
        ids = tok(tok.apply_chat_template(turns, tokenize=False), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def local(rm_dir: str, **cfg: object) -> RewardModelConfig:
    return RewardModelConfig(model=ModelRefConfig(model_path=rm_dir), **cfg)  # type: ignore[arg-type]


def test_a_local_reward_model_scores_each_sample_as_alone(rm_dir) -> None:
    rm = RewardModel(local(rm_dir, batch_size=3))  # one padded batch of three lengths
    scores = rm.score_batch(SAMPLES)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(reference_scores(rm_dir)), atol=1e-5, rtol=1e-5)
    assert len(set(scores)) == 3
    assert rm.stats.drain()["reward_model/requests"] == 1.0


def test_a_local_reward_model_that_scores_nan_is_an_error_not_a_reward(rm_dir) -> None:
    """A head gone NaN (a broken checkpoint) makes every score NaN: counted in errors and answered by `on_error`."""
    from easyrl.scorers import ModelCallError

    rm = RewardModel(RewardModelConfig(model=ModelRefConfig(model_path=rm_dir, on_error="zero")))
    with torch.no_grad():
        rm.model.score.weight.fill_(float("nan"))
    assert rm.score_batch(SAMPLES[:2]) == [0.0, 0.0]
    assert rm.stats.drain() == {"reward_model/requests": 1.0, "reward_model/errors": 1.0}
    rm.cfg.model.on_error = "raise"
    with pytest.raises(ModelCallError, match=r"reward_model: FloatingPointError: the model scored a sample NaN"):
        rm.score(SAMPLES[0])


def test_reward_workers_score_with_the_reward_model_and_count(rm_dir) -> None:
    from easyrl.rewards import RewardManager

    cfg = RewardConfig(reward_function=RM_REWARD, num_workers=1, reward_model=local(rm_dir, batch_size=2))
    with RewardManager(cfg) as manager:
        scores, metrics = manager.score(SAMPLES)
    torch.testing.assert_close(
        torch.tensor([s["overall"] for s in scores]), torch.tensor(reference_scores(rm_dir)), atol=1e-5, rtol=1e-5
    )
    assert metrics["reward_model/requests"] == 2 and metrics["reward_model/errors"] == 0  # batches of 2: 2 + 1


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_routes_send_each_row_to_its_domains_function(tmp_path, rm_dir) -> None:
    from easyrl.rewards import RewardManager

    rule = _write(tmp_path / "rule.py", 'REWARD_TYPE = "sequential"\ndef main(x):\n    return {"overall": 1.0}\n')
    slow = _write(
        tmp_path / "slow.py",
        'import asyncio\nREWARD_TYPE = "sequential"\nasync def main(x):\n    await asyncio.sleep(0)\n'
        '    return {"overall": 2.0}\n',
    )
    rows = [{**s, "domain": d} for s, d in zip(SAMPLES * 2, ["math", "open", "other", "fast", "open", "math"])]
    cfg = RewardConfig(
        reward_function=RM_REWARD,  # the default: rows whose domain has no route ("other", "fast")
        num_workers=0,
        reward_model=local(rm_dir),
        route_key="domain",
        routes={"math": f"{rule}:main", "open": f"{slow}:main"},
    )
    with RewardManager(cfg) as manager:
        scores, _ = manager.score(rows)
    ref = reference_scores(rm_dir)
    got = [s["overall"] for s in scores]
    assert got[0] == 1.0 and got[5] == 1.0 and got[1] == 2.0 and got[4] == 2.0
    assert got[2] == pytest.approx(ref[2], abs=1e-5) and got[3] == pytest.approx(ref[0], abs=1e-5)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_a_remote_reward_model_gives_the_local_scores(tmp_path, rm_dir) -> None:
    """The same checkpoint served by vLLM (`--runner pooling`): the raw scores, through the same reference."""
    from easyrl.testing.vllm_server import VLLMServer

    template = str(REPO / "tests" / "assets" / "rm.jinja")
    with VLLMServer(rm_dir, tmp_path / "rm_server.log", name="tiny-rm", extra_args=("--runner", "pooling")) as srv:
        ref = ModelRefConfig(base_url=srv.base_url, served_model_name="tiny-rm")
        remote = RewardModel(RewardModelConfig(model=ref))  # the server applies the chat template
        scores = remote.score_batch(SAMPLES)
        stats = remote.stats.drain()
        templated = RewardModel(RewardModelConfig(model=ref, template=template, batch_size=2)).score_batch(SAMPLES)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(reference_scores(rm_dir)), atol=1e-4, rtol=1e-4)
    assert stats["reward_model/requests"] == 3 and "reward_model/errors" not in stats  # one conversation each
    local_templated = RewardModel(local(rm_dir, template=template)).score_batch(SAMPLES)
    torch.testing.assert_close(torch.tensor(templated), torch.tensor(local_templated), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_training_run_routes_rows_to_a_rule_and_to_the_reward_model(
    ray_session, tmp_path, tiny_model_dir, rm_dir
) -> None:
    """Two steps of GRPO where half the prompts are scored by the digits rule and half by the reward model."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    rows = [
        {"prompt": f"Copy: {a} {b}", "answer": f"{a}{b}", "domain": "rule" if a % 2 else "rm"}
        for a in range(4)
        for b in range(4)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = base_config(tiny_model_dir, {"train": str(data)}, tmp_path / "run")
    conf["worker"]["reward"].update(
        reward_function=RM_REWARD,
        num_workers=1,
        reward_model={"model": {"model_path": rm_dir}},
        route_key="domain",
        routes={"rule": str(REPO / "reward_functions" / "digits.py") + ":compute_score"},
    )
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        trainer.fit()
    finally:
        trainer.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert r["reward_model/requests"] >= 1 and r["reward_model/errors"] == 0 and r["reward/errors"] == 0
        assert "actor/pg_loss" in r
