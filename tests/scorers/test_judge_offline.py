"""The judge without a server: reading scores, rendering its message, failing requests under `on_error`, and the
config checks. The server-backed behaviour is tests/scorers/test_judge_server.py."""

from __future__ import annotations

import os

import pytest

from easyrl.config.model_ref import JudgeConfig, ModelRefConfig
from easyrl.scorers.client import ModelCallError
from easyrl.scorers.judge import Judge, _parser
from easyrl.testing.vllm_server import free_port
from tests.conftest import REPO, base_config, write_config


TEMPLATE = str(REPO / "tests" / "assets" / "judge.jinja")
SAMPLE = {"prompt": "Copy: 1 2", "response": "12", "ground_truth": "12", "level": 3}


def dead_judge(on_error: str = "zero", retries: int = 1, **extra: object) -> Judge:
    """A judge whose server is a port nothing listens on (connection refused at once)."""
    ref = ModelRefConfig(
        base_url=f"http://127.0.0.1:{free_port()}/v1",
        served_model_name="judge",
        max_retries=retries,
        on_error=on_error,
        timeout_s=5,
    )
    return Judge(JudgeConfig(model=ref, template=TEMPLATE, **extra))  # type: ignore[arg-type]


def test_the_default_regex_reads_the_number_after_score() -> None:
    read = _parser(JudgeConfig().parse, "parse")
    assert read("Reasoning...\nScore: 7") == 7.0
    assert read("score = -2.5 then Score: 9") == 9.0  # the last match wins: the judge's conclusion
    assert _parser(JudgeConfig().parse, "parse", "first")("score = -2.5 then Score: 9") == -2.5
    assert read("no verdict here") is None
    whole = _parser(r"\d+", "parse")  # no group: the whole match
    assert whole("rated 8, out of ten") == 8.0 and _parser(r"\d+", "parse", "first")("8/10") == 8.0


def test_a_parse_function_from_a_file_reads_the_reply() -> None:
    read = _parser(str(REPO / "tests" / "assets" / "judge_parse.py") + ":length_score", "parse")
    assert read("abc") == 0.3 and read("x" * 50) == 1.0 and read("") is None


def test_the_template_renders_the_reward_input_and_names_itself_on_a_missing_column(tmp_path) -> None:
    judge = dead_judge()
    (message,) = judge.messages(SAMPLE)
    assert message["role"] == "user" and "Answer to grade: 12" in message["content"]
    assert "Reference answer: 12" in message["content"]
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ rubric }} {{ response }}")
    judge = Judge(JudgeConfig(model=judge.cfg.model, template=str(bad)))
    with pytest.raises(ValueError, match=r"judge template .*bad.jinja: 'rubric' is undefined"):
        judge.messages(SAMPLE)


def test_a_refused_connection_is_retried_then_scored_zero_and_counted() -> None:
    judge = dead_judge(on_error="zero", retries=1)
    verdict = judge.verdict(SAMPLE)
    assert (verdict.score, verdict.text, verdict.ok) == (0.0, None, False)
    stats = judge.stats.drain()
    assert stats == {"judge/requests": 1.0, "judge/retries": 1.0, "judge/errors": 1.0}


def test_with_on_error_raise_the_call_fails_naming_the_judge_and_the_error() -> None:
    judge = dead_judge(on_error="raise", retries=0)
    with pytest.raises(ModelCallError, match=r"judge at http://127.0.0.1:\d+/v1: ConnectionRefusedError: .* 1 time"):
        judge.score(SAMPLE)


def test_a_missing_key_variable_is_named_before_any_request(monkeypatch) -> None:
    monkeypatch.delenv("EASYRL_TEST_NO_SUCH_KEY", raising=False)
    ref = ModelRefConfig(base_url="http://127.0.0.1:9/v1", api_key_env="EASYRL_TEST_NO_SUCH_KEY")
    with pytest.raises(ModelCallError, match=r"EASYRL_TEST_NO_SUCH_KEY .* is not set"):
        Judge(JudgeConfig(model=ref, template=TEMPLATE))


def test_the_key_named_by_api_key_env_is_scrubbed_from_what_the_run_writes(
    tmp_path, tiny_model_dir, digits_data, monkeypatch
) -> None:
    from easyrl.config import load_config_and_secrets, to_masked_dict

    monkeypatch.setenv("EASYRL_TEST_JUDGE_KEY", "sk-judge-0123456789")
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"]["reward_function"] = str(REPO / "reward_functions" / "judge.py") + ":compute_score"
    conf["worker"]["reward"]["judge"] = {
        "model": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "EASYRL_TEST_JUDGE_KEY"},
        "template": TEMPLATE,
    }
    cfg, secrets = load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf))
    assert "sk-judge-0123456789" not in secrets.scrub("the judge said sk-judge-0123456789")
    dump = str(to_masked_dict(cfg, secrets))
    assert "EASYRL_TEST_JUDGE_KEY" in dump and "sk-judge" not in dump  # the variable's name, never its value
    assert os.environ["EASYRL_TEST_JUDGE_KEY"] == "sk-judge-0123456789"


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        ({"judge": {"model": {"base_url": "http://h/v1"}}}, "worker.reward.judge.template: is required"),
        (
            {"judge": {"model": {"model_path": "MODEL"}, "template": "TEMPLATE", "server": {"num_gpus": -1}}},
            "judge.server.num_gpus: must be >= 0",
        ),
        (
            {"judge": {"model": {"model_path": "MODEL", "api_key_env": "K"}, "template": "TEMPLATE"}},
            "judge.model.api_key_env: names a key for a server you run",
        ),
        (
            {"judge": {"model": {"base_url": "http://h/v1"}, "template": "TEMPLATE", "parse": "(["}},
            "judge.parse: '\\(\\[' is neither",
        ),
        ({"judge": {"model": {"base_url": "h:8000"}, "template": "TEMPLATE"}}, "base_url: 'h:8000' is not an http"),
        (
            {"judge": {"model": {"base_url": "http://h/v1", "on_error": "skip"}, "template": "TEMPLATE"}},
            "on_error: 'skip' is not allowed",
        ),
        (
            {"reward_model": {"model": {"model_path": "/nowhere"}}},
            "reward_model.model.model_path: no Hugging Face model",
        ),
        (
            {"judge": {"model": {"base_url": "http://h/v1", "timeout_s": 1e30}, "template": "TEMPLATE"}},
            r"judge\.model\.timeout_s: must be > 0 and at most 86400 seconds",
        ),
        (
            {"judge": {"model": {"base_url": "http://h/v1"}, "template": "TEMPLATE", "parse_match": "any"}},
            r"judge\.parse_match: 'any' is not one of last, first",
        ),
        ({"routes": {"math": "REWARD"}}, "worker.reward.routes: are set but route_key is not"),
        ({"route_key": "domain"}, "worker.reward.route_key: is set but routes is empty"),
        ({"route_key": "d", "routes": {"a": "/nowhere.py:f"}}, "worker.reward.routes.a: reward file not found"),
    ],
    ids=[
        "no_template",
        "local_judge_gpus",
        "local_judge_key",
        "bad_regex",
        "bad_url",
        "on_error",
        "huge_timeout",
        "parse_match",
        "rm_missing",
        "routes",
        "route_key",
        "route_file",
    ],
)
def test_bad_scorer_settings_name_the_key(tmp_path, tiny_model_dir, digits_data, reward, match) -> None:
    import json

    from easyrl.config import ConfigError, load_config

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    text = json.dumps(reward).replace("MODEL", tiny_model_dir).replace("TEMPLATE", TEMPLATE)
    text = text.replace("REWARD", conf["worker"]["reward"]["reward_function"])
    conf["worker"]["reward"].update(json.loads(text))
    with pytest.raises(ConfigError, match=match):
        load_config(write_config(tmp_path / "cfg.yaml", conf))


def test_a_judge_nobody_takes_and_a_judge_nobody_declared_are_refused(tmp_path) -> None:
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardLoadError, RewardManager

    rule = str(REPO / "reward_functions" / "digits.py") + ":compute_score"
    judged = str(REPO / "reward_functions" / "judge.py") + ":compute_score"
    judge = JudgeConfig(
        model=ModelRefConfig(base_url="http://127.0.0.1:9/v1", served_model_name="j"), template=TEMPLATE
    )
    with pytest.raises(RewardLoadError, match=r"worker\.reward\.judge is set, but no reward function takes a 'judge'"):
        RewardManager(RewardConfig(reward_function=rule, num_workers=0, judge=judge))
    with pytest.raises(
        RewardLoadError, match=r"takes a 'judge' argument, but worker\.reward\.judge\.model is not set"
    ):
        RewardManager(RewardConfig(reward_function=judged, num_workers=0))


def test_a_local_judge_outside_a_run_names_the_fix(tiny_model_dir) -> None:
    """A reward manager (or `easyrl check`) built from a config with a local judge: the server comes with a run."""
    from easyrl.config.worker import RewardConfig
    from easyrl.rewards import RewardManager
    from easyrl.scorers import ModelCallError

    judged = str(REPO / "reward_functions" / "judge.py") + ":compute_score"
    judge = JudgeConfig(model=ModelRefConfig(model_path=tiny_model_dir), template=TEMPLATE)
    with pytest.raises(ModelCallError, match=r"judge\.model\.model_path: a local judge is served by `easyrl train`"):
        RewardManager(RewardConfig(reward_function=judged, num_workers=0, judge=judge))


DIGITS_JUDGE = REPO / "reward_functions" / "digits_judge.py"


def digits_judge(on_error: str = "zero") -> Judge:
    """The digits demo's judge settings (scripts/bench_judge.py) on a port nothing listens on."""
    ref = ModelRefConfig(
        base_url=f"http://127.0.0.1:{free_port()}/v1", served_model_name="judge", max_retries=0, on_error=on_error
    )
    template, parse = str(REPO / "prompt_templates" / "digits_judge.jinja"), f"{DIGITS_JUDGE}:read_answer"
    return Judge(JudgeConfig(model=ref, template=template, parse=parse))  # type: ignore[arg-type]


def test_the_digits_judge_reads_the_students_question_and_takes_only_digits_as_an_answer() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "demo" / "model")
    seen = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Copy: 4 1 7"}], tokenize=False, add_generation_prompt=True
    )
    judge = digits_judge()
    assert judge.messages({"prompt": seen}) == [{"role": "user", "content": "Copy: 4 1 7"}]  # the markup is off
    assert judge.parse(" 417\n") == 1.0 and judge.parse("41 7") is None and judge.parse("") is None


def test_the_digits_judge_reward_asks_once_per_prompt_and_scores_zero_without_an_answer() -> None:
    from easyrl.rewards.loader import load_reward_function

    compute_score = load_reward_function(f"{DIGITS_JUDGE}:compute_score").fn
    judge = digits_judge(on_error="zero")
    batch = [{"prompt": p, "response": r, "ground_truth": "12"} for p in ("a", "b") for r in ("12", "1")]
    scores = compute_score(batch, judge=judge)
    assert judge.stats.drain()["judge/requests"] == 2  # a group's samples share their prompt's one request
    assert [s["overall"] for s in scores] == [0.0] * 4 and [s["judge_ok"] for s in scores] == [0.0] * 4
    assert [s["rule"] for s in scores] == [1.0, 0.9 * 0.5 + 0.1 * 0.5] * 2  # logged beside, never the reward


def test_a_judge_sharing_the_trainers_gpu_must_be_given_its_share() -> None:
    """`server.num_gpus: 0` on a GPU run: without `--gpu-memory-utilization` vLLM's default (0.9 of the device) cannot
    fit beside the trainer; the start is refused with one line naming both keys, before anything starts."""
    from dataclasses import replace

    from easyrl.config.model_ref import JudgeConfig, JudgeServerConfig, ModelRefConfig
    from easyrl.config.worker import RewardConfig
    from easyrl.scorers.served import JudgeServerError, LocalJudge

    judge = JudgeConfig(model=ModelRefConfig(model_path="MODEL"), server=JudgeServerConfig(num_gpus=0, args=["--enforce-eager"]))  # fmt: skip
    with pytest.raises(JudgeServerError, match=r"num_gpus=0 shares the trainer's GPU: .*--gpu-memory-utilization in worker\.reward\.judge\.server\.args.*worker\.rollout\.gpu_memory_utilization"):  # fmt: skip
        LocalJudge(replace(RewardConfig(), judge=judge), gpu=True)
