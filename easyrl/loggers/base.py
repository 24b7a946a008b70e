"""The logger interface and the tracker that fans metrics out to every configured logger."""

from __future__ import annotations

from typing import Any

from easyrl.config.secrets import Secrets


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
    """Sends everything to each logger in turn, with the run's secret values scrubbed from every string first:
    the one gate between the run and its files, so no logger can write a secret whatever key it hides under."""

    def __init__(self, loggers: list[Logger], secrets: Secrets) -> None:
        self.loggers = loggers
        self.secrets = secrets

    def log_config(self, config: dict[str, Any]) -> None:
        clean = self.secrets.scrub_tree(config)
        for lg in self.loggers:
            lg.log_config(clean)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # non-finite values are kept: they are evidence
        clean = {self.secrets.scrub(k): float(v) for k, v in sorted(metrics.items())}
        for lg in self.loggers:
            lg.log_metrics(clean, step)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        clean = [self.secrets.scrub_tree(row) for row in rows]
        for lg in self.loggers:
            lg.log_generations(clean, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
