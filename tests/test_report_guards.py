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
