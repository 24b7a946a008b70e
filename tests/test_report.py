"""`easyrl report`: a synthetic run folder becomes an HTML page with plots and a filterable generations table,
checked in a real headless browser when chromium is installed."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from easyrl.cli import main
from easyrl.report import build_report, metric_series, plan_plots, read_jsonl


pytest.importorskip("matplotlib")

STEPS = 12


def _write_run(run_dir: Path, *, full: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, STEPS + 1):
        row: dict[str, float] = {"step": step, "reward/overall": 0.2 + 0.05 * step}
        if full:
            row |= {
                "reward/accuracy": 0.1 + 0.06 * step,
                "reward/format": min(1.0, 0.5 + 0.1 * step),
                "reward/errors": 0.0,
                "response_length/mean": 120.0 + 8 * step,
                "actor/kl_loss": 0.001 * step,
                "actor/entropy": 1.2 - 0.05 * step,
                "actor/grad_norm": 0.5 + 0.1 * math.sin(step),
                "perf/throughput": 900.0 + 10 * step,
                "timing_s/gen": 20.0 + step,
                "timing_s/reward": 2.0,
                "timing_s/update_actor": 15.0,
                "timing_s/step": 37.0 + step + 1.0,
            }
            if step == 7:
                row["actor/grad_norm"] = float("nan")
        lines.append(json.dumps(row))
        if full and step % 4 == 0:
            lines.append(json.dumps({"step": step, "val/reward_score": 0.3 + 0.04 * step}))
    lines.append('{"step": 13, "reward/overall": 0.')  # a line cut short by a killed run
    (run_dir / "experiment_log.jsonl").write_text("\n".join(lines) + "\n")
    gens = [
        {
            "step": 4,
            "prompt": "What is 2+2?",
            "response": "<think>2+2=4</think> \\boxed{4}",
            "ground_truth": "4",
            "score": 1.0,
        },
        {
            "step": 4,
            "prompt": "Name a <b>prime</b> & an even number",
            "response": "9 and 3",
            "ground_truth": "2",
            "score": 0.0,
        },
        {"step": 8, "prompt": "What is 3*3?", "response": "9", "ground_truth": "9", "score": 1.0},
    ]
    if full:
        (run_dir / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gens))


def test_series_and_plots(tmp_path: Path) -> None:
    _write_run(tmp_path)
    series = metric_series(read_jsonl(str(tmp_path / "experiment_log.jsonl")))
    assert series["reward/overall"][0] == list(range(1, STEPS + 1))
    assert series["val/reward_score"][0] == [4, 8, 12]
    names = [p.name for p in plan_plots(series)]
    assert names == ["reward", "response_length", "kl", "entropy", "grad_norm", "throughput", "timing"]
    reward = next(p for p in plan_plots(series) if p.name == "reward")
    assert "reward/errors" not in reward.keys and "val/reward_score" in reward.keys


def test_memory_ledger_gets_its_chart(tmp_path: Path) -> None:
    """The `perf/mem/*` ledger keys are drawn in one chart, labelled by role and phase."""
    rows = [
        {"step": s, "perf/mem/actor/peak_update_gb": 30.0 + s, "perf/mem/ref/peak_ref_gb": 9.0, "perf/throughput": 1.0}
        for s in (1, 2)
    ]
    (tmp_path / "experiment_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = metric_series(read_jsonl(str(tmp_path / "experiment_log.jsonl")))
    memory = next(p for p in plan_plots(series) if p.name == "memory")
    assert memory.keys == ["perf/mem/actor/peak_update_gb", "perf/mem/ref/peak_ref_gb"]
    page = Path(build_report(str(tmp_path))).read_text()
    assert 'id="plot-memory"' in page and (tmp_path / "report_memory.png").stat().st_size > 0


def test_token_prob_error_gets_its_chart_with_the_gate(tmp_path: Path) -> None:
    """`rollout/token_prob_error` (the engine-vs-trainer figure) is drawn alone, with NeMo-RL's 1.05 bound as a
    dotted line; a step that scored no token (the figure left out) is only a gap in its curve."""
    from easyrl.algorithms import logprob_gap
    from easyrl.report import TOKEN_PROB_ERROR, TOKEN_PROB_ERROR_GATE

    assert (TOKEN_PROB_ERROR, TOKEN_PROB_ERROR_GATE) == (
        logprob_gap.TOKEN_PROB_ERROR,
        logprob_gap.TOKEN_PROB_ERROR_GATE,
    )
    rows = [
        {"step": s, "rollout/token_prob_error": 1.0 + 0.01 * s, "rollout/logprob_diff_mean": 0.01 * s} for s in (1, 3)
    ]
    rows.append({"step": 2, "reward/overall": 0.5})
    (tmp_path / "experiment_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = metric_series(read_jsonl(str(tmp_path / "experiment_log.jsonl")))
    plot = next(p for p in plan_plots(series) if p.name == "token_prob_error")
    assert plot.keys == ["rollout/token_prob_error"] and plot.gate == 1.05
    page = Path(build_report(str(tmp_path))).read_text()
    assert 'id="plot-token_prob_error"' in page and (tmp_path / "report_token_prob_error.png").stat().st_size > 0


def test_missing_metrics_are_omitted(tmp_path: Path) -> None:
    _write_run(tmp_path, full=False)
    out = build_report(str(tmp_path))
    page = Path(out).read_text()
    assert page.count("<img ") == 1 and 'id="plot-reward"' in page and 'id="plot-kl"' not in page
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["report_reward.png"]


def test_no_run_files_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "neither experiment_log.jsonl nor generations.jsonl" in capsys.readouterr().err


def test_cli_writes_page_and_pngs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run)
    out = tmp_path / "out" / "page.html"
    assert main(["report", str(run), "--output", str(out)]) == 0
    page = out.read_text()
    pngs = sorted((tmp_path / "out").glob("page_*.png"))
    assert len(pngs) == 7
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == 7 and all(base64.b64decode(e)[:8] == b"\x89PNG\r\n\x1a\n" for e in embedded)
    assert "http://" not in page and "https://" not in page, "the page must not reach the network"
    assert "&lt;b&gt;prime&lt;/b&gt; &amp; an even number" in page  # generations are escaped
    assert "best val/reward_score" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browser(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(profile)})


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    run = tmp_path / "run"
    _write_run(run)
    out = Path(build_report(str(run)))
    url = out.resolve().as_uri()
    dom = _browser(binary, tmp_path / "profile-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    assert dom.stdout.count('<img alt="') == 7
    assert dom.stdout.count("<tr data-step=") == 3
    # The script ran: it rewrote the counter from the server-side text.
    assert '<span id="gen-count">3 of 3 generations</span>' in dom.stdout
    filtered = _browser(binary, tmp_path / "profile-filter", "--dump-dom", url + "#filter=PRIME")
    assert "Uncaught" not in filtered.stderr, filtered.stderr[-2000:]
    assert '<span id="gen-count">1 of 3 generations</span>' in filtered.stdout
    assert filtered.stdout.count('style="display: none;"') == 2
    shot = tmp_path / "report.png"
    res = _browser(binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1200,2000", url)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Uncaught" not in res.stderr, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    keep = os.environ.get("EASYRL_REPORT_SCREENSHOT")
    if keep:  # for a human look: EASYRL_REPORT_SCREENSHOT=/tmp/report.png pytest tests/test_report.py
        shutil.copy(shot, keep)


def test_metric_keys_are_plain_text_not_latex(tmp_path: Path) -> None:
    """A metric key holding bad TeX (`$\\undefinedmacro$`) is drawn literally instead of crashing the report."""
    key = "reward/$\\undefinedmacro$"
    rows = [{"step": s, "reward/overall": 0.1 * s, key: 0.2 * s} for s in range(1, 4)]
    (tmp_path / "experiment_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report_reward.png").stat().st_size > 0


def test_output_replaces_only_an_earlier_report_and_never_enters_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: `--output` overwrote any file, the run's own log or a checkpoint's manifest included."""
    run = tmp_path / "run"
    _write_run(run)
    checkpoint = run / "global_step_1"
    checkpoint.mkdir()
    (checkpoint / "COMPLETE").write_text("{}")
    (tmp_path / "notes.html").write_text("mine")
    (tmp_path / "plots_reward.png").write_text("mine too")
    log_before = (run / "experiment_log.jsonl").read_bytes()
    refused = {
        run / "experiment_log.jsonl": "is not an earlier easyrl report",
        checkpoint / "COMPLETE": "inside the checkpoint",
        checkpoint / "new.html": "inside the checkpoint",  # a new file in a checkpoint is refused too
        tmp_path / "notes.html": "is not an earlier easyrl report",
        tmp_path / "plots.html": "would overwrite",  # its plots would replace a user's plots_reward.png
    }
    for output, message in refused.items():
        assert main(["report", str(run), "--output", str(output)]) == 2, output
        err = capsys.readouterr().err
        assert message in err and str(output) in err and err.count("\n") == 1, err
    assert (run / "experiment_log.jsonl").read_bytes() == log_before
    assert (checkpoint / "COMPLETE").read_text() == "{}" and not (checkpoint / "new.html").exists()
    assert (tmp_path / "notes.html").read_text() == "mine" and (
        tmp_path / "plots_reward.png"
    ).read_text() == "mine too"
    assert not list(tmp_path.glob("notes_*.png")) and not list(checkpoint.glob("*.png"))
    page = tmp_path / "page.html"
    assert main(["report", str(run), "--output", str(page)]) == 0
    assert main(["report", str(run), "--output", str(page)]) == 0  # an earlier report (and its plots) is replaced
