"""`scripts/gpu_checks.sh`: its plan fits a lent machine's limits, the README names its real stages, and its
machinery (bounded runs, kept summaries, the closing table) works on CPU (`cpu_smoke`, seconds)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts/gpu_checks.sh"


def _run(*args: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, **({"OUT": str(out)} if out else {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _stages() -> list[str]:
    table = re.search(r'^TABLE="\n(.*?)^"', SCRIPT.read_text(), re.M | re.S)
    assert table is not None
    return list(dict.fromkeys(line.split("|")[0] for line in table.group(1).splitlines() if line.count("|") >= 4))


def test_plan_fits_the_lent_machine() -> None:
    """Every stage's runs fit its 390 s budget, every session the 15 minutes (900 s) of device time a task is lent,
    the install's last part runs a session's first stage, and every GPU stage but the noted ones is called once,
    those never run on a lent machine before those already measured."""
    proc = _run("plan")
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in proc.stdout.splitlines() if line.startswith("call:")]
    runs = [int(m.group(1)) for line in calls if (m := re.search(r"runs <= (\d+) s", line))]
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


def test_cpu_smoke_reports_each_run_honestly(tmp_path: Path) -> None:
    """A run that succeeds keeps its summary, one that crashes says so with its error line, one that runs past its
    limit says it timed out; the table comes last."""
    proc = _run("cpu_smoke", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "smoke_ok.status").read_text().strip() == "ok"
    assert (tmp_path / "smoke_ok.json").exists(), "the run's summary.json was not kept"
    assert (tmp_path / "smoke_crash.status").read_text().startswith("crashed or failed (exit 1): RuntimeError")
    assert (tmp_path / "smoke_timeout.status").read_text().strip() == "timed out after 2 s"
    table = (tmp_path / "cpu_smoke.table.md").read_text()
    assert "| smoke_ok | ok | 1.000 |" in table and "| smoke_timeout | timed out after 2 s |" in table
    unknown = _run("nonsense", out=tmp_path)
    assert unknown.returncode == 2 and "unknown stage nonsense" in unknown.stderr
