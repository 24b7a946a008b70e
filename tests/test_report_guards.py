"""`easyrl report` on a log it did not write itself: a step that is no integer is skipped with one warning line
instead of a traceback (issue 36)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from easyrl.cli import main
from easyrl.report import metric_series


pytest.importorskip("matplotlib")


def test_non_integer_steps_are_skipped_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = [{"step": 1, "reward/overall": 0.1}, {"step": 2.0, "reward/overall": 0.2}]
    rows += [{"step": bad, "reward/overall": 9.0} for bad in ("three", 2.5, None, True, [4], {"n": 5})]
    lines = [json.dumps(r) for r in rows] + ['{"step": 1e999, "reward/overall": 9.0}']  # inf after parsing
    (tmp_path / "experiment_log.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="easyrl.report"):
        assert metric_series([json.loads(line) for line in lines])["reward/overall"] == ([1, 2], [0.1, 0.2])
        assert main(["report", str(tmp_path)]) == 0
    assert "7 logged rows have a step that is not an integer (first: 'three'); skipped" in caplog.text


def test_huge_numbers_and_deep_nesting_in_a_log_are_skipped_with_one_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python's JSON parser raises ValueError on a 5,000-digit integer and RecursionError on 5,000-deep nesting;
    an integer of 400 digits parses, but no float holds it. Each is a line the report skips or a value it drops."""
    good = [{"step": 1, "reward/overall": 0.1}, {"step": 2, "reward/overall": 0.2}]
    lines = [json.dumps(r) for r in good] + [
        '{"step": 3, "reward/overall": ' + "9" * 5000 + "}",
        '{"step": 3, "deep": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"step": 3, "reward/overall": ' + "9" * 400 + "}",
        '{"step": ' + "9" * 400 + ', "reward/overall": 0.5}',
    ]
    (tmp_path / "experiment_log.jsonl").write_text("\n".join(lines) + "\n")
    gens = [{"step": 1, "prompt": "p", "response": "r", "ground_truth": "g", "score": 10**400}]
    (tmp_path / "generations.jsonl").write_text(
        "\n".join([json.dumps(g) for g in gens] + ['{"step": ' + "1" * 5000 + "}", "[" * 5000]) + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="easyrl.report"):
        assert main(["report", str(tmp_path)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    text = caplog.text
    assert "experiment_log.jsonl:3 is not valid JSON" in text and "experiment_log.jsonl:4 is not valid JSON" in text
    assert "generations.jsonl:2 is not valid JSON" in text and "generations.jsonl:3 is not valid JSON" in text
    series = metric_series([json.loads(line) for line in lines[:2] + lines[4:]])
    assert series["reward/overall"] == ([1, 2], [0.1, 0.2])  # the unconvertible value and step are dropped
    page = (tmp_path / "report.html").read_text()
    assert "1e+400" not in page and "9999999999" not in page
