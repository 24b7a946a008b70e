"""The console logger written to a file or a pipe (nohup, a batch job's log): one whole line per step, no bar."""

from __future__ import annotations

import pytest

from easyrl.loggers.console import ConsoleLogger


def test_step_lines_are_whole_and_labelled_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    console = ConsoleLogger(total_steps=80)
    metrics = {
        "reward/overall": 0.6848123,
        "val/reward_score": 0.7284123,
        "response_length/mean": 5.789123,
        "actor/pg_loss": 0.03234123,
        "actor/entropy": 1.234567,
        "actor/grad_norm": 0.7037123,
        "timing_s/step": 0.1984123,
        "perf/throughput": 14000.0,
    }
    for step in (40, 41):
        console.log_metrics(metrics, step)
    console.close()
    lines = capsys.readouterr().out.splitlines()
    # before: wrapped at 80 columns ("... grad_norm=0.7037 \nstep=0.1984"), and the bar's last frame cut with "…"
    assert lines == [
        f"step {step}: overall=0.6848 val=0.7284 length=5.789 pg_loss=0.03234 entropy=1.235 grad_norm=0.7037 "
        "s/step=0.1984"
        for step in (40, 41)
    ]
