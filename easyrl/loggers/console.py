"""Console output: a progress bar with step/total, ETA and the current reward, and a short line per step."""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from easyrl.loggers.base import Logger


logger = logging.getLogger("easyrl")
_HEADLINE = (
    "reward/overall",
    "val/reward_score",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "timing_s/step",
)


class ConsoleLogger(Logger):
    def __init__(self, total_steps: int) -> None:
        self.console = Console(stderr=False, highlight=False)
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, status="")
        self._started = False

    def log_config(self, config: dict[str, Any]) -> None:
        del config  # printed by the CLI's plan, not again here

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._started:
            self.progress.start()
            self._started = True
        parts = [
            f"{k.split('/')[-1] if k != 'val/reward_score' else 'val'}={metrics[k]:.4g}"
            for k in _HEADLINE
            if k in metrics
        ]
        status = " ".join(parts)
        self.progress.update(self.task, completed=step, status=status)
        self.progress.console.print(f"step {step}: {status}")

    def close(self) -> None:
        if self._started:
            self.progress.stop()
