"""Where metrics go: the console (a progress bar), a local jsonl file, and experiment trackers.

Every logger is reached through `Tracker`, which scrubs the run's secret values from every string it passes on
(config, metric keys, generations): secrets never reach a logger.
"""

from __future__ import annotations

from easyrl.loggers.base import Logger, Tracker
from easyrl.loggers.build import build_tracker
from easyrl.loggers.console import ConsoleLogger
from easyrl.loggers.file import FileLogger


__all__ = ["ConsoleLogger", "FileLogger", "Logger", "Tracker", "build_tracker"]
