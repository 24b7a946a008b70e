"""Secrets (a reward-function api_key and an ${oc.env:...} value) appear in no output file and no console."""

from __future__ import annotations

import pytest

from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
KWARG_SECRET = "sk-kwarg-7f3a9c1e5b"
ENV_SECRET = "env-secret-42d8b6a0"


def test_secrets_never_written_or_printed(tmp_path, tiny_model_dir, digits_data, monkeypatch, capfd) -> None:
    monkeypatch.setenv("EASYRL_TEST_JUDGE_TOKEN", ENV_SECRET)
    edits = {
        "worker.reward.reward_function_kwargs": {
            "api_key": KWARG_SECRET,
            "judge": "${oc.env:EASYRL_TEST_JUDGE_TOKEN}",
        },
        "trainer.logger": ["console", "file"],
        "trainer.val_generations_to_log": 2,
        "data.val_files": digits_data["val"],
        "trainer.val_before_train": True,
    }
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, edits, steps=1)
    assert rows, "the run logged nothing"
    out, err = capfd.readouterr()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "experiment_config.json" for p in files)
    for secret in (KWARG_SECRET, ENV_SECRET):
        assert secret not in out and secret not in err
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, f"{secret} written to {leaked}"
    config_text = (tmp_path / "run" / "experiment_config.json").read_text()
    assert '"api_key": "***"' in config_text and '"judge": "***"' in config_text
