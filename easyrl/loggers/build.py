"""`build_tracker`: the loggers a run's `trainer.logger` names, behind one `Tracker` (above the logger classes, so
they import only the interface in `base`)."""

from __future__ import annotations

from easyrl.loggers.base import Logger, Tracker
from easyrl.loggers.console import ConsoleLogger
from easyrl.loggers.file import FileLogger


def build_tracker(names: list[str], run_dir: str, project: str, experiment: str, total_steps: int) -> Tracker:
    """The loggers named in `trainer.logger`."""
    loggers: list[Logger] = []
    for name in names:
        if name == "console":
            loggers.append(ConsoleLogger(total_steps))
        elif name == "file":
            loggers.append(FileLogger(run_dir))
        else:
            from easyrl.loggers.trackers import build_external

            loggers.append(build_external(name, run_dir, project, experiment))
    return Tracker(loggers)
