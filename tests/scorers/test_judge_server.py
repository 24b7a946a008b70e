"""The judge and the remote distillation teacher against a real OpenAI-compatible server: vLLM (the CPU build)
serving a tiny model built here, started by this module and killed by it, mid-run, to show `on_error`.

The tests run in order on one server (starting one costs 20-60 s on CPU): verdicts, the key, the reward worker
processes' counters; the teacher's prompt log-probs of the student's sampled tokens against a local forward pass, and
a training run that distills through it; then a training run whose judge dies after its first step.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from easyrl.config.model_ref import JudgeConfig, JudgeSamplingConfig, ModelRefConfig
from easyrl.scorers.judge import Judge
from tests.conftest import REPO, base_config, write_config


pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]
KEY_ENV = "EASYRL_TEST_JUDGE_KEY"
KEY = "sk-easyrl-judge-test-4f9c"
TEMPLATE = str(REPO / "tests" / "assets" / "judge.jinja")
PARSE = str(REPO / "tests" / "assets" / "judge_parse.py") + ":length_score"
JUDGE_REWARD = str(REPO / "reward_functions" / "judge.py") + ":compute_score"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    from easyrl.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("judge_server") / "server.log"
    srv = VLLMServer(tiny_model_dir, log, name="tiny-judge", api_key=KEY).start()
    yield srv
    srv.kill()


@pytest.fixture(autouse=True)
def judge_key(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def judge_config(server, **ref: object) -> JudgeConfig:
    model = ModelRefConfig(base_url=server.base_url, api_key_env=KEY_ENV, timeout_s=30, **ref)  # type: ignore[arg-type]
    return JudgeConfig(model=model, template=TEMPLATE, parse=PARSE, sampling=JudgeSamplingConfig(max_tokens=8))


def samples(count: int) -> list[dict[str, object]]:
    return [
        {"prompt": f"Copy: {i} {i + 1}", "response": f"{i}{i + 1}", "ground_truth": f"{i}{i + 1}"}
        for i in range(count)
    ]


def test_a_verdict_is_the_servers_reply_to_the_rendered_template_read_by_parse(server) -> None:
    import openai

    judge = Judge(judge_config(server))
    sample = samples(1)[0]
    verdict = judge.verdict(sample)
    # The same request made by hand: the served model's name was asked of the server, the key sent, the reply read.
    direct = openai.OpenAI(base_url=server.base_url, api_key=KEY).chat.completions.create(
        model="tiny-judge", messages=judge.messages(sample), temperature=0.0, top_p=1.0, max_tokens=8, seed=0
    )
    text = direct.choices[0].message.content
    assert verdict.text == text and verdict.ok
    assert verdict.score == min(len(text), 10) / 10
    assert judge.verdict(sample) == verdict  # temperature 0 and a seed: the same verdict again
    stats = judge.stats.drain()
    assert stats["judge/requests"] == 3 and "judge/errors" not in stats  # the model lookup, then two verdicts


def test_a_wrong_key_is_refused_without_retries_and_never_shown(server, monkeypatch) -> None:
    from easyrl.scorers import ModelCallError

    monkeypatch.setenv(KEY_ENV, "sk-wrong-key-000")
    judge = Judge(judge_config(server, served_model_name="tiny-judge", max_retries=3, on_error="raise"))
    with pytest.raises(ModelCallError, match="HTTPStatusError: HTTP 401") as failure:
        judge.score(samples(1)[0])
    assert "sk-wrong-key-000" not in str(failure.value) and KEY not in str(failure.value)
    assert judge.stats.drain() == {"judge/requests": 1.0, "judge/errors": 1.0}  # a 401 is not retried


def test_reward_workers_call_the_judge_and_send_their_counts_back(server) -> None:
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardManager

    judge = judge_config(server, name="grader", served_model_name="tiny-judge")  # no lookup: 8 requests exactly
    cfg = RewardConfig(reward_function=JUDGE_REWARD, num_workers=2, judge=judge)
    batch = samples(8)
    with RewardManager(cfg) as manager:
        scores, metrics = manager.score(batch)
    expected = [v.score for v in Judge(judge_config(server)).verdict_batch(batch)]
    assert [s["overall"] for s in scores] == expected
    assert [s["judge_ok"] for s in scores] == [1.0] * 8
    # named by the model's `name`, counted in whichever worker process made them
    assert metrics["grader/requests"] == 8 and metrics["grader/errors"] == 0 and metrics["grader/retries"] == 0
    assert metrics["grader/latency_s"] > 0 and metrics["reward/errors"] == 0


# ----------------------------------------------------------------- the same server as a distillation teacher
def test_the_teachers_log_probs_of_the_sampled_tokens_are_a_local_forward_pass(server, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from easyrl.batch import Batch
    from easyrl.scorers.teacher import RemoteTeacher

    g = torch.Generator().manual_seed(0)
    # two rows as the rollout lays them out: left-padded prompts (4 and 2 tokens), right-padded responses (3 and 1)
    prompts = torch.tensor([[11, 12, 13, 14], [256, 256, 21, 22]])
    responses = torch.tensor([[31, 32, 33], [41, 256, 256]])
    pmask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    rmask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch = Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "responses": responses,
            "response_mask": rmask,
            "old_log_probs": torch.randn(2, 3, generator=g),
        }
    )
    got = RemoteTeacher(ModelRefConfig(base_url=server.base_url, api_key_env=KEY_ENV)).compute_teacher_log_probs(
        batch
    )["teacher_log_probs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = torch.zeros(2, 3)
    for i in range(2):
        seq = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
        n = int(rmask[i].sum())
        targets = seq[-n:]
        expected[i, :n] = logp[len(seq) - n - 1 : len(seq) - 1].gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert got[1, 1:].eq(0).all()  # padding stays 0


def test_a_run_distills_through_the_served_teacher(ray_session, server, tmp_path, tiny_model_dir, digits_data) -> None:
    """The served teacher is the student's own checkpoint: at step 1 the two agree on every sampled token (up to
    vLLM's float sums against torch's), and every sample cost one counted request."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    teacher = {"base_url": server.base_url, "api_key_env": KEY_ENV, "tokenizer_path": tiny_model_dir}
    conf["algorithm"]["distill"] = {"teacher": teacher}
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    first = rows[0]
    assert abs(first["distill/reverse_kl"]) < 1e-4 and first["distill/teacher_log_prob"] < -1.0
    # one model lookup at the first step, then one request per sample (4 prompts x 2)
    assert [r["teacher/requests"] for r in rows] == [9.0, 8.0] and all(r["teacher/errors"] == 0 for r in rows)
    assert abs(rows[1]["distill/reverse_kl"]) > 1e-4  # the student moved, the served teacher did not


def test_the_judge_killed_mid_run_scores_zero_or_stops_the_run(
    ray_session, server, tmp_path, tiny_model_dir, digits_data
) -> None:
    """Step 1 is judged; the server is killed; step 2 trains on zero verdicts (`on_error: zero`), every one counted
    after its retry; with `on_error: raise` the same dead judge stops scoring with a RewardError naming it."""
    from easyrl.config import load_config_and_secrets
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardError, RewardManager
    from easyrl.trainer.trainer import Trainer

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    reward = conf["worker"]["reward"]
    reward.update(reward_function=JUDGE_REWARD, num_workers=1)
    reward["judge"] = {
        "model": {"base_url": server.base_url, "api_key_env": KEY_ENV, "max_retries": 1, "on_error": "zero"},
        "template": TEMPLATE,
        "parse": PARSE,
        "sampling": {"max_tokens": 8},
    }
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        trainer.total_steps = 1
        trainer.fit()
        server.kill()
        trainer.total_steps = 2
        trainer.fit()
    finally:
        trainer.close()
    first, second = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    samples_per_step = 4 * 2
    assert first["judge/errors"] == 0 and first["reward/overall"] > 0
    assert first["reward/judge_ok"] == 1 - first["judge/parse_errors"] / samples_per_step  # an empty reply is unread
    assert second["judge/errors"] == samples_per_step and second["judge/retries"] == samples_per_step
    assert second["reward/overall"] == 0.0 and second["reward/judge_ok"] == 0.0 and second["reward/errors"] == 0
    assert "actor/pg_loss" in second  # the run went on

    cfg = RewardConfig(reward_function=JUDGE_REWARD, num_workers=0, judge=judge_config(server, max_retries=0))
    with (
        RewardManager(cfg) as manager,
        pytest.raises(RewardError, match=r"ModelCallError: judge at http://.*ConnectionRefusedError"),
    ):
        manager.score(samples(4))
    assert Path(server.log_path).is_file()
