"""`build_tracker`: the loggers a run's `trainer.logger` names, behind one `Tracker` (above the logger classes, so
they import only the interface in `base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from easyrl.loggers.base import Logger, Tracker
from easyrl.loggers.console import ConsoleLogger
from easyrl.loggers.file import FileLogger


if TYPE_CHECKING:
    from easyrl.config.secrets import Secrets


def build_tracker(
    names: list[str], run_dir: str, project: str, experiment: str, total_steps: int, secrets: Secrets
) -> Tracker:
    """The loggers named in `trainer.logger`, behind a gate that scrubs `secrets` from all they receive."""
    loggers: list[Logger] = []
    for name in names:
        if name == "console":
            loggers.append(ConsoleLogger(total_steps))
        elif name == "file":
            loggers.append(FileLogger(run_dir))
        else:
            from easyrl.loggers.trackers import build_external

            loggers.append(build_external(name, run_dir, project, experiment))
    return Tracker(loggers, secrets)
