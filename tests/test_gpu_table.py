"""`scripts/gpu_table.py`: the one table a stage of `scripts/gpu_checks.sh` ends with, honest about dead runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("gpu_table", REPO / "scripts" / "gpu_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_rows_for_measured_crashed_and_missing_runs(tmp_path: Path) -> None:
    (tmp_path / "bench_1.5b.status").write_text("ok\n")
    (tmp_path / "bench_1.5b.json").write_text(
        json.dumps({"timing_s/step": [59.5, 61.0], "raw_vllm_tokens_per_s": 30000.0, "gen_vs_raw_vllm": 0.96})
    )
    (tmp_path / "vl.status").write_text("ok\n")
    (tmp_path / "vl.json").write_text(json.dumps({"steps": [{"timing_s/step": 10.0}, {"timing_s/step": 12.0}]}))
    (tmp_path / "bench_3b.status").write_text("crashed or failed (exit 1): RuntimeError: CUDA error\n")
    lines = _module().table(tmp_path, ["bench_1.5b", "vl", "bench_3b", "never"]).splitlines()
    assert lines[0].startswith("| run | status | step s | gen tok/s |")
    assert lines[2].startswith("| bench_1.5b | ok | 59.5 |") and "| 30,000 |" in lines[2] and "| 0.960 |" in lines[2]
    assert lines[3].startswith("| vl | ok | 11.0 |")  # the median over bench_vl's steps
    assert lines[4].startswith("| bench_3b | crashed or failed (exit 1): RuntimeError: CUDA error |")
    assert lines[5].startswith("| never | did not run |")
