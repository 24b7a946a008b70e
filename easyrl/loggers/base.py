"""The logger interface and the tracker that fans metrics out to every configured logger."""

from __future__ import annotations

from typing import Any


class Logger:
    """One destination for metrics. Subclasses override what they support."""

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's (masked) config, once at the start."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics."""

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        """Validation generations: prompt, response, ground truth, score."""

    def close(self) -> None:
        """Flush and release."""


class Tracker:
    """Sends everything to each logger in turn."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def log_config(self, config: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_config(config)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in sorted(metrics.items())}  # non-finite values are kept: they are evidence
        for lg in self.loggers:
            lg.log_metrics(clean, step)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        for lg in self.loggers:
            lg.log_generations(rows, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
