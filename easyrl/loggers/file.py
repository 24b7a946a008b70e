"""A local file logger: one JSON object per step in `experiment_log.jsonl` (with `step`), generations in
`generations.jsonl`, and the masked config in `experiment_config.json`, all under the run folder.

The config record is never overwritten: a resume under another config adds `experiment_config.resume<N>.json`
(N = 1, 2, ...), so the folder keeps every configuration the run was trained under, in order. A run that starts over
from step 1 in a folder with an earlier run's logs (nothing to resume from) sets them aside as
`experiment_log.before<N>.jsonl` / `generations.before<N>.jsonl` instead of appending to them: a report of the folder
then shows this run only, and the earlier one is kept."""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any

from easyrl.loggers.base import Logger


logger = logging.getLogger(__name__)


_LOGS = ("experiment_log", "generations")


def set_aside_earlier_logs(run_dir: str) -> str | None:
    """Rename an earlier run's non-empty logs in `run_dir` to the first free `<name>.before<N>.jsonl`; returns the
    suffix used (None when there was nothing to set aside)."""
    paths = [os.path.join(run_dir, f"{name}.jsonl") for name in _LOGS]
    if not any(os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths):
        return None
    n = next(
        n
        for n in itertools.count(1)
        if not any(os.path.exists(os.path.join(run_dir, f"{name}.before{n}.jsonl")) for name in _LOGS)
    )
    for name, path in zip(_LOGS, paths, strict=True):
        if os.path.isfile(path):
            os.replace(path, os.path.join(run_dir, f"{name}.before{n}.jsonl"))
    return f"before{n}"


class FileLogger(Logger):
    def __init__(self, run_dir: str, fresh: bool = False) -> None:
        """`fresh`: this run starts at step 1 (nothing resumed): an earlier run's logs in the folder are set aside."""
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        if fresh and (suffix := set_aside_earlier_logs(run_dir)) is not None:
            logger.info(
                "%s: an earlier run's logs set aside as *.%s.jsonl (this run starts at step 1)", run_dir, suffix
            )
        self._metrics = open(os.path.join(run_dir, "experiment_log.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        self._generations = open(os.path.join(run_dir, "generations.jsonl"), "a", encoding="utf-8")  # noqa: SIM115

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, default=str)
        records = [os.path.join(self.run_dir, "experiment_config.json")]
        for n in itertools.count(1):
            if not os.path.exists(records[-1]):
                break
            records.append(os.path.join(self.run_dir, f"experiment_config.resume{n}.json"))
        path = records[-1]  # the first free name
        if len(records) > 1:
            with open(records[-2], encoding="utf-8") as f:
                if f.read() == text:
                    return  # resumed under the same config as last time: nothing new to record
        with open(path, "x", encoding="utf-8") as f:  # "x": an existing record is never replaced
            f.write(text)

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
