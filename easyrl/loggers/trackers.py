"""Experiment trackers: tensorboard, wandb, swanlab and mlflow, each an optional extra (`easyrl[loggers]`).

Every tracker runs locally unless credentials or an explicit mode are configured:

- tensorboard: event files under `<run_dir>/tensorboard`.
- wandb: `mode="offline"` (files under `<run_dir>/wandb`) unless `WANDB_MODE` is set, or an API key is
  available (`WANDB_API_KEY`, or a `wandb login` entry in `~/.netrc`), in which case wandb's own default applies.
- swanlab: offline mode (files under `<run_dir>/swanlog`) unless `SWANLAB_MODE` or `SWANLAB_API_KEY` is set.
- mlflow: a local store under `<run_dir>/mlruns` (sqlite database + artifact folder) unless `MLFLOW_TRACKING_URI`
  is set.

What each receives: the step metrics, the masked config (hyperparameters / run config), and validation
generations (prompt, response, ground truth, score) as a table where the tracker has one. Environment
variables and the command line (which may carry secret overrides) are never sent.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import re
from typing import Any
from urllib.parse import urlparse

from easyrl.loggers.base import Logger


logger = logging.getLogger(__name__)

GENERATION_COLUMNS = ("step", "prompt", "response", "ground_truth", "score")
# Which pip package each tracker needs.
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}


class TrackerNotInstalledError(ImportError):
    """A tracker named in `trainer.logger` whose package is missing."""


def build_external(name: str, run_dir: str, project: str, experiment: str) -> Logger:
    """The tracker called `name` (tensorboard, wandb, swanlab or mlflow), writing under `run_dir`."""
    builders = {
        "tensorboard": TensorboardLogger,
        "wandb": WandbLogger,
        "swanlab": SwanlabLogger,
        "mlflow": MlflowLogger,
    }
    if name not in builders:
        known = ", ".join(["console", "file", *builders])
        raise ValueError(f"trainer.logger has unknown logger {name!r}; known loggers: {known}")
    return builders[name](run_dir, project, experiment)


def _require(name: str) -> Any:
    """Import the tracker's package, or raise a `TrackerNotInstalledError` saying how to install it."""
    import importlib

    package = _PACKAGES[name]
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise TrackerNotInstalledError(
            f"trainer.logger has {name!r} but the {package} package is not installed: "
            f"pip install 'easyrl[loggers]' or pip install {package}"
        ) from exc


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists, None and other non-scalars as strings (for hparam tables)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, path))
        elif isinstance(value, (bool, int, float, str)):
            out[path] = value
        else:
            out[path] = json.dumps(value, default=str)
    return out


def generation_rows(rows: list[dict[str, Any]], step: int) -> list[list[Any]]:
    """Rows as lists in `GENERATION_COLUMNS` order; text as strings, score as float."""
    table = []
    for row in rows:
        score = row.get("score")
        table.append(
            [
                step,
                str(row.get("prompt", "")),
                str(row.get("response", "")),
                str(row.get("ground_truth", "")),
                float(score) if isinstance(score, (int, float)) else math.nan,
            ]
        )
    return table


def _markdown_table(rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(GENERATION_COLUMNS) + " |", "|" + " --- |" * len(GENERATION_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- tensorboard
class TensorboardLogger(Logger):
    """Scalars, the config (as text and as hparams) and generations (as a markdown text table)."""

    def __init__(self, run_dir: str, project: str, experiment: str) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        logger.info("tensorboard: event files in %s (tensorboard --logdir %s)", self.log_dir, self.log_dir)

    def log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)
        experiment, start, end = hparams(flatten_config(config), {})
        file_writer = self.writer._get_file_writer()  # the writer's own event file (add_hparams makes a new one)
        for summary in (experiment, start, end):
            file_writer.add_summary(summary)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        self.writer.add_text("val/generations", _markdown_table(generation_rows(rows, step)), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------------------------------------- wandb
def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str | None:
    """`offline` unless WANDB_MODE is set or an API key is configured (then None: wandb decides)."""
    if os.environ.get("WANDB_MODE") or _wandb_has_key():
        return None
    return "offline"


class WandbLogger(Logger):
    """A wandb run: metrics via `log`, the config as run config, generations as a `wandb.Table`."""

    def __init__(self, run_dir: str, project: str, experiment: str) -> None:
        self.wandb = _require("wandb")
        os.makedirs(run_dir, exist_ok=True)
        mode = wandb_mode()
        # No run metadata: it records the command line, where `key=value` overrides may carry secrets.
        settings = self.wandb.Settings(x_disable_meta=True, disable_code=True, disable_git=True, silent=True)
        self.run = self.wandb.init(project=project, name=experiment, dir=run_dir, mode=mode, settings=settings)
        self._rows: list[list[Any]] = []
        where = "offline, sync later with `wandb sync`" if mode == "offline" else "online"
        logger.info("wandb: run %s (%s) under %s", self.run.id, where, run_dir)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        # One growing table: each log holds every generation so far, the step in a column.
        self._rows += generation_rows(rows, step)
        table = self.wandb.Table(columns=list(GENERATION_COLUMNS), data=[list(r) for r in self._rows])
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------------------- swanlab
def swanlab_mode() -> str:
    """SWANLAB_MODE when set; online when SWANLAB_API_KEY is set; otherwise offline (local files, `swanlab sync`
    uploads them later; `swanlab watch` browses them with `pip install 'swanlab[dashboard]'`)."""
    if os.environ.get("SWANLAB_MODE"):
        return os.environ["SWANLAB_MODE"]
    return "online" if os.environ.get("SWANLAB_API_KEY") else "offline"


class SwanlabLogger(Logger):
    """A swanlab experiment: metrics via `log`, the config as experiment config, generations as an echarts
    table (and as text, one entry per generation)."""

    def __init__(self, run_dir: str, project: str, experiment: str) -> None:
        import inspect

        self.swanlab = _require("swanlab")
        self.log_dir = os.path.join(run_dir, "swanlog")
        os.makedirs(self.log_dir, exist_ok=True)
        mode = swanlab_mode()
        params = inspect.signature(self.swanlab.init).parameters
        kwargs: dict[str, Any] = {"project": project, "mode": mode}
        if "log_dir" in params:  # swanlab >= 0.10
            kwargs.update(name=experiment, log_dir=self.log_dir)
            try:  # the runtime probe records the command line, where `key=value` overrides may carry secrets
                kwargs["settings"] = self.swanlab.Settings(probe={"runtime": False})
            except Exception as exc:
                logger.warning("swanlab: cannot turn off its command-line probe (%s)", exc)
        else:
            kwargs.update(experiment_name=experiment, logdir=self.log_dir)
        self.run = self.swanlab.init(**kwargs)
        logger.info("swanlab: %s mode, files in %s", mode, self.log_dir)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        table_rows = generation_rows(rows, step)
        texts = [
            self.swanlab.Text(f"prompt: {p}\n\nresponse: {r}\n\nground truth: {g}\n\nscore: {s}")
            for _, p, r, g, s in table_rows
        ]
        payload: dict[str, Any] = {"val/generations_text": texts}
        try:
            table = self.swanlab.echarts.Table()
            table.add(list(GENERATION_COLUMNS), table_rows)
            payload["val/generations"] = table
        except Exception as exc:  # echarts tables are newer than text; text alone still carries everything
            logger.debug("swanlab: no echarts table (%s); generations logged as text only", exc)
        self.run.log(payload, step=step)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------------------- mlflow
_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")
_MLFLOW_MAX_PARAM = 6000


def mlflow_tracking_uri(run_dir: str) -> str:
    """MLFLOW_TRACKING_URI when set, else a sqlite store `<run_dir>/mlruns/mlflow.db` (mlflow 3 retired the
    plain file store)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    folder = os.path.abspath(os.path.join(run_dir, "mlruns"))
    os.makedirs(folder, exist_ok=True)
    return "sqlite:///" + os.path.join(folder, "mlflow.db")


class MlflowLogger(Logger):
    """An mlflow run: metrics, the config as params (and `config.json`), generations via `log_table`."""

    def __init__(self, run_dir: str, project: str, experiment: str) -> None:
        _require("mlflow")
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(project)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = None
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                from pathlib import Path

                artifacts = Path(os.path.abspath(os.path.join(run_dir, "mlruns", "artifacts"))).as_uri()
            experiment_id = self.client.create_experiment(project, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self._rows: list[list[Any]] = []
        logger.info("mlflow: run %s in experiment %r at %s", self.run_id, project, self.uri)

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_dict(self.run_id, config, "config.json")
        params = [
            Param(_MLFLOW_BAD.sub("_", k), str(v)[:_MLFLOW_MAX_PARAM]) for k, v in flatten_config(config).items()
        ]
        for start in range(0, len(params), 100):  # mlflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_BAD.sub("_", k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # mlflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        table_rows = generation_rows(rows, step)
        data = {col: [row[i] for row in table_rows] for i, col in enumerate(GENERATION_COLUMNS)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"generations/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
