"""Console output: a short line per step and, on a terminal, a progress bar with step/total, ETA and the current
reward. Written to a file or a pipe (nohup, a batch job), the lines are whole (never wrapped at 80 columns) and no
bar is drawn."""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from easyrl.loggers.base import Logger


logger = logging.getLogger("easyrl")
# metric -> its label in the step line
_HEADLINE = {
    "reward/overall": "overall",
    "val/reward_score": "val",
    "response_length/mean": "length",
    "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy",
    "actor/grad_norm": "grad_norm",
    "train/loss": "loss",  # supervised fine-tuning (`easyrl sft`)
    "train/token_accuracy": "acc",
    "val/loss": "val_loss",
    "timing_s/step": "s/step",
}


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
        status = " ".join(f"{label}={metrics[key]:.4g}" for key, label in _HEADLINE.items() if key in metrics)
        if not self.console.is_terminal:
            self.console.print(f"step {step}: {status}", soft_wrap=True)
            return
        if not self._started:
            self.progress.start()
            self._started = True
        self.progress.update(self.task, completed=step, status=status)
        self.progress.console.print(f"step {step}: {status}")

    def close(self) -> None:
        if self._started:
            self.progress.stop()
