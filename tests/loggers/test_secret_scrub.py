"""Secrets cannot slip past the mask: each known bypass, through real writes (the config dump, the jsonl log, the
tensorboard event file, the mlflow and wandb stores) and through the console of a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from easyrl.config import load_config_and_secrets, to_masked_dict
from easyrl.config.secrets import MIN_SCRUB_CHARS
from easyrl.loggers import build_tracker
from tests.conftest import base_config, write_config
from tests.loggers.test_trackers import clean_env  # noqa: F401  (fixture)


LIST_SECRET = "sk-list-5e1f0a9c77"
BEARER = "Bearer hdr-0c4e2b8a91"
SPACED_ENV_SECRET = "env-spaced-7d2f9b31"
COPIED_SECRET = "judge-9a8b7c6d5e"
PASSWD, CREDENTIALS, AUTH = "pw-3b5d7f9a1c", "cred-2468ace013", "auth-1357bdf024"
# Issue 36: common names outside the first rule, a URL's password, a decoded value, a number copied elsewhere.
NAMED = {
    "bearer": "brr-6a1c9e3f55",
    "passphrase": "phrase-8d0b2f4e66",
    "db_pwd": "pwd-1f3e5d7c99",
    "cookie": "ck-4b6d8f0a22",
    "sentry_dsn": "dsn-9c7e5a3b11",
}
URL_PASSWORD, DECODED, NUMBER = "urlpw-5e7a9c1b33", "dec-2c4e6a8b44", 73194628501
SECRETS = (LIST_SECRET, BEARER, SPACED_ENV_SECRET, COPIED_SECRET, PASSWD, CREDENTIALS, AUTH, *NAMED.values())
SECRETS += (URL_PASSWORD, DECODED, str(NUMBER))


def _load(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("EASYRL_TEST_SPACED", SPACED_ENV_SECRET)
    monkeypatch.setenv("EASYRL_TEST_JUDGE", COPIED_SECRET)
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"]["reward_function_kwargs"] = {
        "api_keys": [LIST_SECRET, "sk-list-second-0000"],  # a list under a secret-named key
        "headers": {"Authorization": BEARER},  # a nested mapping
        "endpoint": "${ oc.env:EASYRL_TEST_SPACED}",  # an environment value written with a space
        "judge": "${oc.env:EASYRL_TEST_JUDGE}",
        "judge_copy": "${.judge}",  # an interpolation copying it under an innocent key
        "passwd": PASSWD,
        "credentials": CREDENTIALS,
        "auth": AUTH,
        "model": "gpt-judge",  # not a secret: kept
        **NAMED,
        "database": f"postgresql://alice:{URL_PASSWORD}@db.internal:5432/rl",  # credentials inside a URL
        "options": f"${{oc.decode:'{{region: {DECODED}}}'}}",  # decoded to a mapping under an innocent name
        "api_key": NUMBER,  # a number under a secret name ...
        "retries_seed": "${.api_key}",  # ... copied by interpolation under an innocent one
    }
    return load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf))


def test_every_bypass_is_masked_in_the_config_dump(tmp_path, tiny_model_dir, digits_data, monkeypatch) -> None:
    cfg, secrets = _load(tmp_path, tiny_model_dir, digits_data, monkeypatch)
    kwargs = cfg.worker.reward.reward_function_kwargs
    assert kwargs["judge_copy"] == COPIED_SECRET and kwargs["endpoint"] == SPACED_ENV_SECRET  # resolved for use
    masked = to_masked_dict(cfg, secrets)["worker"]["reward"]["reward_function_kwargs"]
    assert masked["api_keys"] == ["***", "***"] and masked["headers"] == {"Authorization": "***"}
    assert masked["judge_copy"] == "***" and masked["model"] == "gpt-judge"
    assert masked["options"] == "***" and masked["retries_seed"] == "***"
    assert masked["database"] == "postgresql://***@db.internal:5432/rl"  # the rest of the URL stays readable
    assert kwargs["options"] == {"region": DECODED} and kwargs["retries_seed"] == NUMBER
    text = repr(to_masked_dict(cfg, secrets))
    assert not [s for s in SECRETS if s in text]
    assert to_masked_dict(cfg, secrets)["data"]["prompt_key"] == "prompt"  # our own *_key fields stay


def test_no_tracker_file_holds_a_secret(tmp_path, tiny_model_dir, digits_data, monkeypatch, clean_env) -> None:  # noqa: F811
    """The config, a metric key and a generation carrying secrets, written by real file/tensorboard/mlflow/wandb
    loggers: no byte of any secret in any file they wrote."""
    cfg, secrets = _load(tmp_path, tiny_model_dir, digits_data, monkeypatch)
    names = ["file", "tensorboard", "mlflow", "wandb"]
    tracker = build_tracker(names, str(clean_env), "p", "e", total_steps=1, secrets=secrets)
    tracker.log_config(to_masked_dict(cfg, secrets))
    tracker.log_metrics({f"reward/{COPIED_SECRET}": 1.0, "reward/overall": 0.5}, 1)
    row = {"prompt": f"use {BEARER}", "response": f"the key is {LIST_SECRET}", "ground_truth": PASSWD, "score": 1}
    tracker.log_generations([row], 1)
    tracker.close()
    files = [p for p in clean_env.rglob("*") if p.is_file()]
    written = {p.parent.name if p.parent != clean_env else p.name for p in files}
    assert {"experiment_config.json", "experiment_log.jsonl", "generations.jsonl", "tensorboard"} <= written
    for secret in SECRETS:
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, f"{secret!r} written to {leaked}"
    assert "reward/***" in (clean_env / "experiment_log.jsonl").read_text()


def test_console_and_log_lines_are_scrubbed(tmp_path: Path) -> None:
    """A real process: after `guard_console`, a secret printed, logged, or in a traceback reaches neither stream."""
    script = tmp_path / "leak.py"
    script.write_text(
        "import logging, sys\n"
        "from easyrl.config.secrets import Secrets, guard_console\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"guard_console(Secrets(values=({COPIED_SECRET!r},)))\n"
        f"print('printed', {COPIED_SECRET!r})\n"
        f"print('to stderr', {COPIED_SECRET!r}, file=sys.stderr)\n"
        f"logging.getLogger('x').info('logged %s', {COPIED_SECRET!r})\n"
        "try:\n"
        f"    raise ValueError({COPIED_SECRET!r})\n"
        "except ValueError:\n"
        "    logging.getLogger('x').exception('failed')\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert COPIED_SECRET not in both
    assert both.count("***") == 5, both  # print, stderr, log line, and the traceback (source line, message)


def test_short_values_are_masked_by_path_only(tmp_path, tiny_model_dir, digits_data) -> None:
    """A secret shorter than MIN_SCRUB_CHARS is masked where it sits, not searched for in every string."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"]["reward_function_kwargs"] = {"token": "ab"}
    cfg, secrets = load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf))
    assert len("ab") < MIN_SCRUB_CHARS and "ab" not in secrets.values
    assert to_masked_dict(cfg, secrets)["worker"]["reward"]["reward_function_kwargs"]["token"] == "***"


def test_url_credentials_are_masked_even_when_unknown_or_short() -> None:
    """A URL's userinfo is masked by its place in any text (a log line, an error), not only when the config held it."""
    from easyrl.config.secrets import Secrets

    line = "cannot reach https://u:pw@hub.internal/x, nor https://ghp_0123456789@github.com/o/r.git"
    assert Secrets().scrub(line) == "cannot reach https://***@hub.internal/x, nor https://***@github.com/o/r.git"
