"""A newcomer's own task, the way README.md and docs/rewards_and_templates.md tell it: a folder with a jsonl of their
own columns, a reward file, a jinja template and a config derived from configs/demo.yaml, run from the folder above
it with the `easyrl` command: `check`, a 2-step `train`, then `report` opened in a real (headless) browser.

What this path once got wrong, each kept here: `check` passed a validation file that `train` then refused; a config
kept beside its data named its files relative to its own folder (they are read from the working directory) and got
"not found: train.jsonl"; a one-input reward without `REWARD_TYPE` was called with a list."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO


REWARD = '''"""Sorting: exact match, and partial credit for the right digits in any order."""

REWARD_TYPE = "sequential"


def compute_score(reward_input, exact_weight=0.5):
    response = reward_input["response"].strip()
    answer = reward_input["ground_truth"]
    exact = float(response == answer)
    digits = float(sorted(response) == sorted(answer))
    assert reward_input["kind"] == "Sort"  # the row's own columns come along
    return {"overall": exact_weight * exact + (1 - exact_weight) * digits, "exact": exact, "digits": digits}
'''


def _rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for _ in range(count):
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
        rows.append(
            {"question": " ".join(map(str, digits)), "solution": "".join(map(str, sorted(digits))), "kind": "Sort"}
        )
    return rows


def _write_task(root: Path) -> None:
    """root/mytask/: data, reward, template and config, every path relative to `root` (where easyrl runs)."""
    task = root / "mytask"
    task.mkdir(parents=True)
    rng = random.Random(0)
    for name, count in (("train", 64), ("val", 8)):
        (task / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(count, rng)))
    (task / "reward.py").write_text(REWARD)
    (task / "prompt.jinja").write_text("{{ kind }}: {{ content }}\n")
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"].update(
        train_files="mytask/train.jsonl",
        val_files="mytask/val.jsonl",
        prompt_key="question",
        answer_key="solution",
        format_prompt="mytask/prompt.jinja",
        rollout_batch_size=8,
    )
    config["worker"]["actor"]["global_batch_size"] = 8
    config["worker"]["actor"]["model"]["model_path"] = str(REPO / "assets" / "demo" / "model")
    config["worker"]["rollout"]["n"] = 4
    config["worker"]["reward"].update(
        reward_function="mytask/reward.py:compute_score", reward_function_kwargs={"exact_weight": 0.5}
    )
    config["trainer"].update(experiment_name="sort", max_steps=2, val_freq=2, val_before_train=False)
    (task / "config.yaml").write_text(yaml.safe_dump(config))


def _easyrl(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "easyrl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The task written, checked and trained for 2 steps (`easyrl check`, then `easyrl train`)."""
    root = tmp_path_factory.mktemp("newcomer")
    _write_task(root)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    check = _easyrl(["check", "mytask/config.yaml"], root, env)
    ray_tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: Ray's socket paths live under it
    env.pop("RAY_ADDRESS", None)
    try:
        train = _easyrl(["train", "mytask/config.yaml"], root, {**env, "TMPDIR": str(ray_tmp)})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {"root": root, "run": root / "checkpoints" / "easyrl" / "sort", "check": check, "train": train}


def test_own_task_checks_and_trains(newcomer: dict[str, Any]) -> None:
    check, train, run = newcomer["check"], newcomer["train"], newcomer["run"]
    assert check.returncode == 0, check.stderr[-3000:]
    out = check.stdout
    assert "train: 64 usable rows from mytask/train.jsonl" in out
    assert "val: 8 usable rows from mytask/val.jsonl; dropped: none" in out
    assert "<|im_start|>user\nSort: " in out  # the template's own column, then the prompt column
    assert "on the ground truth as response: {'overall': 1.0, 'exact': 1.0, 'digits': 1.0}" in out
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "experiment_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"reward/overall", "reward/exact", "reward/digits"} <= rows[0].keys() and "val/pass@4" in rows[1]
    assert (run / "global_step_2" / "COMPLETE").is_file()
    gens = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 16 and all(g["step"] == 2 and "Sort: " in g["prompt"] for g in gens)
    # whole step lines when the console is not a terminal (a log file): never wrapped mid-metric
    assert [ln.split(":")[0] for ln in train.stdout.splitlines() if ln.startswith("step ")] == ["step 1", "step 2"]


def test_own_task_report_renders_in_headless_chromium(newcomer: dict[str, Any], tmp_path: Path) -> None:
    from tests.test_report import _browser, _chromium

    assert newcomer["train"].returncode == 0, newcomer["train"].stderr[-3000:]
    run = newcomer["run"]
    report = _easyrl(["report", str(run)], newcomer["root"])
    assert report.returncode == 0, report.stderr[-3000:]
    page = run / "report.html"
    assert report.stdout.strip() == str(page)
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): the page was written but not opened")
    url = page.resolve().as_uri()
    dom = _browser(binary, tmp_path / "profile-dom", "--dump-dom", url)
    assert dom.returncode == 0 and "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    for plot in ("reward", "response_length", "grad_norm", "throughput", "timing"):
        assert f'id="plot-{plot}"' in dom.stdout, plot
    assert dom.stdout.count("<tr data-step=") == 16 and "Sort: " in dom.stdout
    assert '<span id="gen-count">16 of 16 generations</span>' in dom.stdout  # the page's script ran
    shot = tmp_path / "report.png"
    res = _browser(binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1200,2000", url)
    assert res.returncode == 0 and "Uncaught" not in res.stderr, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


def test_running_from_the_config_folder_names_the_working_directory(tmp_path: Path) -> None:
    """The first thing a newcomer tries with a config beside its data: `cd mytask && easyrl check config.yaml`."""
    _write_task(tmp_path)
    proc = _easyrl(["check", "config.yaml"], tmp_path / "mytask", {**os.environ, "PYTHONPATH": str(REPO)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("easyrl: config error: data.train_files: not found: mytask/train.jsonl")
    assert f"read from the working directory, {tmp_path / 'mytask'}, not from the config file's folder" in lines[0]
