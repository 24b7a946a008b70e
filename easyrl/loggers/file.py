"""A local file logger: one JSON object per step in `experiment_log.jsonl` (with `step`), generations in
`generations.jsonl`, and the masked config in `experiment_config.json`, all under the run folder."""

from __future__ import annotations

import json
import os
from typing import Any

from easyrl.loggers.base import Logger


class FileLogger(Logger):
    def __init__(self, run_dir: str) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._metrics = open(os.path.join(run_dir, "experiment_log.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        self._generations = open(os.path.join(run_dir, "generations.jsonl"), "a", encoding="utf-8")  # noqa: SIM115

    def log_config(self, config: dict[str, Any]) -> None:
        path = os.path.join(self.run_dir, "experiment_config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, default=str)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._metrics.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self._metrics.flush()

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        for row in rows:
            self._generations.write(json.dumps({"step": step, **row}, default=str) + "\n")
        self._generations.flush()

    def close(self) -> None:
        self._metrics.close()
        self._generations.close()
