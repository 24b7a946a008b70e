"""A dataset row naming an environment the run does not have is caught at load: `easyrl check` and `easyrl train`
stop before anything starts with one line naming the row and the known environments (issue 45, item 3); mid-run it
would only have been a dropped trajectory. The demo config with two environments routed by the `env` column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, easyrl_in_process


def _easyrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "easyrl.cli", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_a_row_naming_an_unknown_environment_stops_check_and_train_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)  # the demo's paths are relative to the repository root
    rows = [{"prompt": f"{a}*3", "answer": str(3 * a), "env": "calc" if a != 4 else "calculator"} for a in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps(rows[0]) + "\n")
    overrides = [
        f"data.train_files={data}",
        f"data.val_files={val}",
        "worker.rollout.multi_turn.env=null",
        "+worker.rollout.multi_turn.envs.calc=envs/calc.py:CalcEnv",
        "+worker.rollout.multi_turn.envs.other=envs/calc.py:CalcEnv",
        f"trainer.save_checkpoint_path={tmp_path / 'run'}",
    ]
    line = (
        f"{data}, row 4: row column 'env' (worker.rollout.multi_turn.env_key) is 'calculator'; "
        "worker.rollout.multi_turn.envs has: calc, other"
    )
    check = easyrl_in_process(capsys, "check", "configs/demo_tools.yaml", *overrides)
    assert check.returncode == 2 and "Traceback" not in check.stderr, check.stderr[-3000:]
    assert check.stderr.strip().splitlines()[-1] == f"easyrl: data error: {line}"
    train = _easyrl("train", "configs/demo_tools.yaml", *overrides)
    assert train.returncode == 1 and "Traceback" not in train.stderr, train.stderr[-3000:]
    assert train.stderr.strip().splitlines()[-1] == f"easyrl: DataError: {line}"
    assert not (tmp_path / "run").exists()  # stopped before anything started


def test_check_names_an_environment_whose_constructor_needs_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    env = tmp_path / "needs.py"
    env.write_text(
        "class Needs:\n    def __init__(self, board):\n        pass\n    def reset(self, **row):\n        return 'x'\n"
    )
    check = easyrl_in_process(capsys, "check", "configs/demo_tools.yaml", f"worker.rollout.multi_turn.env={env}:Needs")
    assert check.returncode == 2 and "Traceback" not in check.stderr, check.stderr[-3000:]
    last = check.stderr.strip().splitlines()[-1]
    # `check` reads the constructor's signature before building one (`check.constructor_problem`)
    assert last.startswith("easyrl: multi-turn error: environment default (") and "Needs) takes constructor" in last
    assert "arguments (board); each episode builds one with none: give them defaults" in last, last
