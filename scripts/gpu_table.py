"""One markdown table for a stage of `scripts/gpu_checks.sh`: a row per run, from `$OUT/<run>.status` and the
summary `$OUT/<run>.json` that `scripts/benchmark.py` or `scripts/bench_vl.py` wrote (absent when the run died).

Usage: python scripts/gpu_table.py OUT_DIR RUN [RUN ...]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


COLUMNS = (
    ("step s", "timing_s/step"),
    ("gen tok/s", "gen_tokens_per_s"),
    ("engine tok/s", "engine_tokens_per_s"),
    ("raw vLLM tok/s", "raw_vllm_tokens_per_s"),
    ("gen / raw", "gen_vs_raw_vllm"),
    ("engine / raw", "engine_vs_raw_vllm"),
    ("tok/s/GPU", "perf/throughput"),
    ("update MFU", "mfu_update_true"),
    ("peak training GB", "peak_memory_gb"),
    ("engine GB", "engine_memory_gb"),
    ("peak device GB", "peak_device_memory_gb"),
    ("device GB", "device_total_gb"),
    ("logprob diff max", "rollout/logprob_diff_max"),
    ("token prob error", "rollout/token_prob_error"),
)


def median_of(summary: dict[str, Any], key: str) -> float | None:
    """A benchmark summary's value (its median when it holds (median, p90)); for a bench_vl summary, the median over
    its `steps` rows."""
    value = summary.get(key)
    if isinstance(value, list) and value:
        value = value[0]
    if value is None and summary.get("steps"):
        values = [row[key] for row in summary["steps"] if key in row]
        value = statistics.median(values) if values else None
    return float(value) if isinstance(value, (int, float)) else None


def _cell(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return ""
    if abs(value) < 10:
        return f"{value:.3f}"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def table(out: Path, runs: list[str]) -> str:
    lines = [
        "| run | status | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for run in runs:
        status_file = out / f"{run}.status"
        status = status_file.read_text().strip() if status_file.exists() else "did not run"
        summary_file = out / f"{run}.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        cells = [_cell(median_of(summary, key)) for _, key in COLUMNS]
        lines.append(f"| {run} | {status} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]), sys.argv[2:]))
