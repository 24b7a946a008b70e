"""What every run does around its loop, RL (`Trainer`) and SFT (`SFTTrainer`) alike: one run per folder (a lock),
the checkpoint to resume from and the config it was saved under, the loggers, atomic checkpoints of the trained
roles with the driver's state, exact resume, and stopping cleanly on a signal.

A run names its trained worker groups (`trained_groups`), the driver state a resumed run needs
(`trainer_state` / `restore_driver_state`), and what a resume restores beyond that (`after_resume`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from easyrl.checkpoint import (
    RUN_CONFIG,
    CheckpointManager,
    fsio,
    read_run_config,
    read_trainer_state,
    write_trainer_state,
)
from easyrl.checkpoint.lock import RunLock
from easyrl.config import EasyRLConfig, Secrets, to_masked_dict
from easyrl.config.resume_diff import resume_config_report


logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite updates in a row, online-filtering budget spent, ...)."""


class StopRequested(RuntimeError):
    """A SIGTERM/SIGINT/SIGHUP asked the run to stop; it stopped at a stage boundary (after saving, if asked)."""


class RunFolder:
    """The base of a run's driver: its folder, checkpoints, loggers and stop signal."""

    cfg: EasyRLConfig
    global_step: int
    total_steps: int
    stop_signal: str | None
    """Set by a SIGTERM/SIGINT/SIGHUP handler; honoured between stages."""

    def open_run(self, cfg: EasyRLConfig, secrets: Secrets, higher_is_better: bool = True) -> str | None:
        """Lock the run folder, find the checkpoint to resume from (checking its config against this one) and start
        the loggers, all before any process starts; sets `trained_to`. Returns the checkpoint to resume from.
        `higher_is_better`: how the validation score a checkpoint records ranks them (`save_limit` keeps the best)."""
        from easyrl.loggers import build_tracker

        run_dir = cfg.trainer.save_checkpoint_path or "."
        # First, before anything touches the folder (the manager below removes leftovers of interrupted saves):
        # a second run on the same folder stops here.
        self.run_lock = RunLock(run_dir).acquire()
        self.ckpt = CheckpointManager(run_dir, cfg.trainer.save_limit, higher_is_better)
        # Before any process starts: an explicit checkpoint that is missing or incomplete fails right here.
        resume_from = self.ckpt.resolve_load(
            cfg.trainer.load_checkpoint_path,
            cfg.trainer.find_last_checkpoint,
            verify=cfg.trainer.verify_checkpoint,
            fallback=cfg.trainer.fallback_to_older_checkpoint,
        )
        # The masked config as JSON data (tuples as lists): saved with each checkpoint, compared on resume.
        self.config_record = json.loads(json.dumps(to_masked_dict(cfg, secrets), default=str))
        if resume_from is not None:
            self.check_resume_config(resume_from)  # before any process starts: a refused resume is quick
        # Before any process starts too: a tracker that cannot start (a package that fails to import, a bad
        # folder) fails in a second, not after Ray and the workers.
        self.tracker = build_tracker(
            cfg.trainer.logger,
            run_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            self.total_steps,
            secrets,
            fresh=resume_from is None,
        )
        self.tracker.log_config(self.config_record)
        self.trained_to = self.finished_at(resume_from)
        return resume_from

    # ------------------------------------------------------------------ what a run defines
    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last step's metrics."""
        raise NotImplementedError

    def trainer_state(self) -> dict[str, Any]:
        """Everything of the driver a resumed run needs to continue on the same curve (JSON-able)."""
        raise NotImplementedError

    def restore_driver_state(self, state: dict[str, Any]) -> None:
        """Put the driver back to `state` (from `trainer_state()`)."""
        raise NotImplementedError

    def trained_groups(self) -> list[tuple[str, Any]]:
        """(checkpoint subfolder, worker group) of every role whose weights a checkpoint holds."""
        raise NotImplementedError

    def after_resume(self) -> None:
        """What a resume restores beyond the workers' state and the driver's (nothing by default)."""

    # ------------------------------------------------------------------ checkpoints
    def should_save(self) -> bool:
        freq = self.cfg.trainer.save_freq
        return (freq > 0 and self.global_step % freq == 0) or self.global_step == self.total_steps

    def save_checkpoint(self, val_score: float | None) -> None:
        """Write `global_step_<N>` atomically: workers' shards and the trainer state into a temporary folder,
        then rename; the previous checkpoints stay until this one is complete."""
        model_only = self.cfg.trainer.save_model_only
        tmp = self.ckpt.begin(self.global_step)
        try:
            calls = [
                group.call_async("save_checkpoint", os.path.join(tmp, role), model_only)
                for role, group in self.trained_groups()
            ]
            for call in calls:
                call.result()
            if not model_only:
                write_trainer_state(tmp, self.trainer_state())
            fsio.write_json(os.path.join(tmp, RUN_CONFIG), self.config_record)
            self.ckpt.commit(tmp, self.global_step, val_score)
        except BaseException:
            self.ckpt.abort(tmp)
            raise

    def resume(self, folder: str) -> None:
        """Continue from the checkpoint `folder` (chosen by `CheckpointManager.resolve_load`: the explicit
        `trainer.load_checkpoint_path`, or the newest complete one with `trainer.find_last_checkpoint`)."""
        logger.info("resuming from %s", folder)
        calls = [
            group.call_async("load_checkpoint", os.path.join(folder, role)) for role, group in self.trained_groups()
        ]
        for call in calls:
            call.result()
        state, rng = read_trainer_state(folder)
        self.restore_driver_state(state)
        self.after_resume()
        rng.restore()

    def finished_at(self, resume_from: str | None) -> int | None:
        """The step of `resume_from` when it already reached `total_steps` (and the run is not `val_only`), read from
        its trainer state alone; None when there is training left."""
        if resume_from is None or self.cfg.trainer.val_only:
            return None
        done = int(read_trainer_state(resume_from)[0]["global_step"])
        return done if done >= self.total_steps else None

    def check_resume_config(self, folder: str) -> None:
        """Compare the config with the one `folder` was saved under: name what changed, refuse a changed model
        unless `trainer.allow_model_change_on_resume` (see `easyrl.config.resume_diff`)."""
        saved = read_run_config(folder)
        if saved is None:
            logger.info("%s was saved without its config (an older easyrl): changes cannot be named", folder)
            return
        allow = self.cfg.trainer.allow_model_change_on_resume
        # the schema's defaults, as the record writes them: a key newer than the checkpoint, at its default, is no change
        defaults = json.loads(json.dumps(to_masked_dict(EasyRLConfig(), Secrets()), default=str))
        info, warnings = resume_config_report(saved, self.config_record, folder, allow, defaults)
        for line in info:
            logger.info(line)
        for line in warnings:
            logger.warning(line)

    def log_already_trained(self) -> None:
        logger.info(
            "already trained to step %d of %d (the checkpoint's): nothing to do; raise trainer.max_steps or "
            "trainer.total_epochs to train on, or remove %s to train again",
            self.trained_to,
            self.total_steps,
            self.cfg.trainer.save_checkpoint_path,
        )

    # ------------------------------------------------------------------ stopping
    def request_stop(self, signal_name: str) -> None:
        """Stop at the next stage boundary, saving first when `trainer.save_on_interrupt` is set; the loop then
        raises `StopRequested`."""
        self.stop_signal = signal_name

    def stop_cleanly(self) -> None:
        logger.warning("%s: stopping after step %d", self.stop_signal, self.global_step)
        if self.cfg.trainer.save_on_interrupt and self.global_step > 0:
            latest = self.ckpt.latest()
            if latest is None or not latest.endswith(f"global_step_{self.global_step}"):
                self.save_checkpoint(None)
        raise StopRequested(f"stopped by {self.stop_signal} after step {self.global_step}")

    def close(self) -> None:
        """Release everything this run started; safe on a partly built run."""
        if hasattr(self, "tracker"):
            self.tracker.close()
        if hasattr(self, "workers"):
            self.workers.shutdown()
        if hasattr(self, "run_lock"):
            self.run_lock.release()
