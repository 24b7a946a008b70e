"""`scripts/gpu_checks.sh`: its plan fits a lent machine's limits (the recipe matrix first), the README names its real
stages, and its machinery works on CPU (`cpu_smoke`): bounded runs, kept summaries, the closing table, the recipe
runner over the HF engine; the runners report a failure, a hang and a death each with its cause."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts/gpu_checks.sh"


def _run(*args: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, **({"OUT": str(out)} if out else {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _stages() -> list[str]:
    table = re.search(r'^TABLE="\n(.*?)^"', SCRIPT.read_text(), re.M | re.S)
    assert table is not None
    return list(dict.fromkeys(line.split("|")[0] for line in table.group(1).splitlines() if line.count("|") >= 4))


def test_plan_fits_the_lent_machine() -> None:
    """The recipe matrix is the first call after the install, in at most 480 s with its cold start, leaving at least
    250 s of the loan; every other stage's runs fit its 390 s budget, every session the 15 minutes (900 s) of device
    time a task is lent, the install's last part runs a session's first stage, and every GPU stage but the noted ones
    is called once, those never run on a lent machine before those already measured."""
    proc = _run("plan")
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in proc.stdout.splitlines() if line.startswith("call:")]
    assert calls[3].endswith(calls[3].split("&&")[-1]) and "gpu_checks.sh recipes " in calls[3], calls[3]
    first = re.search(r"unpack ~(\d+) s \+ runs <= (\d+) s; session's device time ~(\d+) s", calls[3])
    assert first is not None
    unpack, recipes, used = (int(g) for g in first.groups())
    assert unpack + recipes <= 480 and 900 - used >= 250, (unpack, recipes, used)
    runs = [int(m.group(1)) for line in calls[4:] if (m := re.search(r"runs <= (\d+) s", line))]
    assert runs and max(runs) <= 390, runs
    sessions = [int(m.group(1)) for line in calls if (m := re.search(r"device time ~(\d+) s", line))]
    assert sessions and max(sessions) <= 900, sessions
    called = re.findall(r"gpu_checks\.sh (\w+)", "\n".join(calls))
    assert "bash .gpu-bundle/stash.sh && bash scripts/gpu_checks.sh " + called[0] in proc.stdout
    measured = re.search(r"^MEASURED=\"(.*)\"", SCRIPT.read_text(), re.M)
    assert measured is not None and measured.group(1).split() == called[-len(measured.group(1).split()) :]
    noted = {"cpu_smoke", "sp", "vllm033"}
    assert sorted(called) == sorted(set(_stages()) - noted), "a stage is missing from the plan or called twice"
    assert all(f"# {stage}:" in proc.stdout for stage in noted - {"cpu_smoke"})


def test_readme_names_the_real_stages() -> None:
    line = re.search(r"`scripts/gpu_checks\.sh ([\w|]+)`", (ROOT / "README.md").read_text())
    assert line is not None
    assert set(line.group(1).split("|")) == set(_stages()) - {"cpu_smoke"}


@pytest.mark.slow
def test_cpu_smoke_reports_each_run_honestly(tmp_path: Path) -> None:
    """A run that succeeds keeps its summary, one that crashes says so with its error line, one that runs past its
    limit says it timed out; the table comes last. The recipe runner runs its CPU recipes over the HF engine, each
    passing its checks (2 steps, the updated policy sampling step 2, the numerics gate) with its figures."""
    proc = _run("cpu_smoke", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "recipes_cpu.status").read_text().strip() == "ok", (tmp_path / "recipes_cpu.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "recipes.jsonl").read_text().splitlines()]
    assert [r["recipe"] for r in rows] == ["qwen2_5", "lora_merged", "ppo_critic"]
    for row in rows:
        assert row["status"] == "pass" and 1.0 <= row["token_prob_error"] <= 1.05, row
    assert "| qwen2_5 | family | pass |" in (tmp_path / "recipes.table.md").read_text()
    assert (tmp_path / "smoke_ok.status").read_text().strip() == "ok"
    assert (tmp_path / "smoke_ok.json").exists(), "the run's summary.json was not kept"
    assert (tmp_path / "smoke_crash.status").read_text().startswith("crashed or failed (exit 1): RuntimeError")
    assert (tmp_path / "smoke_timeout.status").read_text().strip() == "timed out after 2 s"
    table = (tmp_path / "cpu_smoke.table.md").read_text()
    assert "| smoke_ok | ok | 1.000 |" in table and "| smoke_timeout | timed out after 2 s |" in table
    unknown = _run("nonsense", out=tmp_path)
    assert unknown.returncode == 2 and "unknown stage nonsense" in unknown.stderr


def test_the_recipe_runner_reports_a_failure_a_hang_and_a_death_with_their_causes(tmp_path: Path) -> None:
    """Run side by side in two processes: a failed check keeps its message and a failure file at once; a hang is
    stopped at its limit and says where it was stuck; a process that dies is a crash with its log's last line; the
    recipe after each still runs (in a fresh process where the old one was stopped)."""
    names = "selfcheck_hangs,selfcheck_fails,selfcheck_dies"
    cmd = [sys.executable, "-m", "tests.recipes", "--device", "cpu", "--out", str(tmp_path), "--only", names, "--jobs", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["recipe"]: r for r in map(json.loads, (tmp_path / "recipes.jsonl").read_text().splitlines())}
    assert rows["selfcheck_fails"]["status"] == "fail"
    assert rows["selfcheck_fails"]["error"] == "check failed: a check that does not hold (runner self-check)"
    hang = rows["selfcheck_hangs"]
    assert hang["status"].startswith("timed out after") and "stuck at tests/recipes/matrix.py" in hang["error"], hang
    died = rows["selfcheck_dies"]
    assert died["status"] == "crashed (exit 3)" and "exits in the middle of a recipe" in (tmp_path / "failures" / "selfcheck_dies.txt").read_text()  # fmt: skip
    assert "RecipeFailed" in (tmp_path / "failures" / "selfcheck_fails.txt").read_text()
    assert "0 of 3 recipes passed" in proc.stdout


def test_each_gpu_test_is_its_own_bounded_run(tmp_path: Path) -> None:
    """`tests.recipes.each_test`: one pytest process per test id; a failure is written to `failures/` by the conftest
    hook with its exception and captured output; a hang is stopped at its limit and says where; the others pass."""
    cmd = [sys.executable, "-m", "tests.recipes.each_test", "--out", str(tmp_path), "--limit", "8", "--", "tests/assets/bounded_cases.py"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, (tmp_path / "tests.jsonl").read_text().splitlines())}
    assert rows["test_passes"]["status"] == "pass"
    assert rows["test_fails"]["status"] == "fail (exit 1)" and "1 failed" in rows["test_fails"]["summary"]
    assert (
        rows["test_hangs"]["status"] == "timed out after 8 s, stuck at tests/assets/bounded_cases.py:12 in test_hangs"
    )
    (failure,) = (tmp_path / "failures").iterdir()
    text = failure.read_text()
    assert "a failure the runner must report with its cause" in text and "what the driver printed" in text
