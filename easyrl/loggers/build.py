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
    names: list[str],
    run_dir: str,
    project: str,
    experiment: str,
    total_steps: int,
    secrets: Secrets,
    fresh: bool = False,
) -> Tracker:
    """The loggers named in `trainer.logger`, behind a gate that scrubs `secrets` from all they receive. `fresh`: the
    run starts at step 1 (nothing resumed), so the file logger sets an earlier run's logs aside."""
    loggers: list[Logger] = []
    for name in names:
        if name == "console":
            loggers.append(ConsoleLogger(total_steps))
        elif name == "file":
            loggers.append(FileLogger(run_dir, fresh))
        else:
            from easyrl.loggers.trackers import build_external

            loggers.append(build_external(name, run_dir, project, experiment))
    return Tracker(loggers, secrets)
