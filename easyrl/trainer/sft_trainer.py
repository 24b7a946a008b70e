"""The SFT driver (`easyrl sft`): builds the data and the policy's workers, and runs supervised fine-tuning.
`fit()` reads as the algorithm: next batch, one optimizer step, metrics, validation, checkpoint.

Everything around the loop (the run folder's lock, checkpoints and exact resume, the loggers, stop signals) is the
RL trainer's own (`easyrl.trainer.run.RunFolder`); the workers are the actor's training machinery with the next-token
loss (`easyrl.workers.sft`).
"""

from __future__ import annotations

import logging
from typing import Any

from easyrl.algorithms.sft import validation_metrics
from easyrl.batch import Batch
from easyrl.config import EasyRLConfig, Secrets
from easyrl.trainer.plan import plan_of
from easyrl.trainer.run import RunFolder, TrainingError
from easyrl.trainer.sft_math import count_sft_steps, fill_for_workers, step_metrics
from easyrl.trainer.timer import timer
from easyrl.trainer.worker_groups import SFTWorkers


logger = logging.getLogger(__name__)


def build_sft_data(cfg: EasyRLConfig) -> tuple[Any, Any, Any, Any]:
    """Tokenizer, train conversations, validation conversations (or None) and the resumable row sampler."""
    from easyrl.config import ConfigError
    from easyrl.data import PromptSampler
    from easyrl.data.sft import SFTDataset
    from easyrl.models import load_tokenizer

    mcfg = cfg.worker.actor.model
    assert mcfg.tokenizer_path is not None  # the loader defaults it to model_path
    logger.info("loading tokenizer from %s", mcfg.tokenizer_path)
    tokenizer, _ = load_tokenizer(mcfg.tokenizer_path, trust_remote_code=mcfg.trust_remote_code)
    logger.info("loading and checking training conversations %s", cfg.data.train_files)
    train = SFTDataset(cfg.data.train_files, cfg.data, cfg.sft, tokenizer)
    val = SFTDataset(cfg.data.val_files, cfg.data, cfg.sft, tokenizer) if cfg.data.val_files else None
    rows = cfg.worker.actor.global_batch_size
    if len(train) < rows:
        raise ConfigError(
            "worker.actor.global_batch_size", f"{rows} rows per step is more than the {len(train)} usable rows"
        )
    sampler = PromptSampler(len(train), rows, cfg.data.shuffle, cfg.data.seed)
    return tokenizer, train, val, sampler


class SFTTrainer(RunFolder):
    def __init__(self, cfg: EasyRLConfig, secrets: Secrets) -> None:
        self.cfg = cfg
        self.tokenizer, self.train_data, self.val_data, self.sampler = build_sft_data(cfg)
        acfg, tcfg = cfg.worker.actor, cfg.trainer
        self.total_steps = count_sft_steps(
            len(self.train_data), acfg.global_batch_size, tcfg.total_epochs, tcfg.max_steps
        )
        self.world_size = tcfg.nnodes * tcfg.n_gpus_per_node
        self.dp = self.world_size // acfg.sp_size  # data-parallel groups: the parts a batch splits into
        self.global_step = 0
        self.stop_signal: str | None = None
        self.consecutive_skips = 0
        try:
            # the lock, the checkpoint to resume, the loggers; the best checkpoint is the lowest validation loss
            resume_from = self.open_run(cfg, secrets, higher_is_better=False)
            if self.trained_to is not None:
                return  # trained to the end already: no Ray, no workers to start
            self.workers = SFTWorkers(cfg, plan_of(cfg, "sft"), self.total_steps)
            self.actor = self.workers.actor
            if resume_from is not None:
                self.resume(resume_from)
        except BaseException:
            self.close()  # release whatever started (workers, the placement group)
            raise

    # ------------------------------------------------------------------ the algorithm
    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last step's metrics."""
        metrics: dict[str, float] = {}
        if self.trained_to is not None:
            self.log_already_trained()
            return metrics
        if self.cfg.trainer.val_before_train or self.cfg.trainer.val_only:
            val = self.validate()
            self.tracker.log_metrics(val, self.global_step)
            if self.cfg.trainer.val_only:
                return val
        while self.global_step < self.total_steps and self.stop_signal is None:
            self.global_step += 1
            timings: dict[str, float] = {}
            with timer("step", timings):
                batch = self.next_batch()
                with timer("update", timings):
                    metrics = self.actor.train_step(batch)
            self.check_skipped_updates(metrics)
            metrics |= step_metrics(batch, timings, self.world_size) | {"train/epoch": float(self.sampler.epoch)}
            metrics |= {f"timing_s/{k}": v for k, v in timings.items()}
            metrics |= self.workers.memory_metrics()
            if self.should_validate():
                metrics |= self.validate()
            if self.should_save():
                with timer("save", timings):
                    self.save_checkpoint(metrics.get("val/loss"))
                metrics["timing_s/save"] = timings["save"]
            self.tracker.log_metrics(metrics, self.global_step)
        if self.stop_signal is not None:
            self.stop_cleanly()
        return metrics

    # ------------------------------------------------------------------ stages
    def next_batch(self) -> Batch:
        """The next `worker.actor.global_batch_size` conversations from the resumable sampler."""
        from easyrl.data.sft import collate_sft

        items = [self.train_data[i] for i in self.sampler.next_indices()]
        return Batch(collate_sft(items, self.tokenizer.pad_token_id))

    def should_validate(self) -> bool:
        freq = self.cfg.trainer.val_freq
        last = self.global_step == self.total_steps
        return self.val_data is not None and freq > 0 and (self.global_step % freq == 0 or last)

    def validate(self) -> dict[str, float]:
        """`val/loss` (per-token NLL), `val/token_accuracy`, `val/perplexity` over every trained token of the
        validation set, `data.val_batch_size` rows a call (-1: all at once)."""
        from easyrl.data.sft import collate_sft

        if self.val_data is None:
            return {}
        size = self.cfg.data.val_batch_size if self.cfg.data.val_batch_size > 0 else len(self.val_data)
        nll = top1 = tokens = 0.0
        for start in range(0, len(self.val_data), size):
            items = [self.val_data[i] for i in range(start, min(start + size, len(self.val_data)))]
            batch = Batch(collate_sft(items, self.tokenizer.pad_token_id))
            sums = self.actor.evaluate(fill_for_workers(batch, self.dp))
            nll, top1, tokens = nll + sums["nll_sum"], top1 + sums["top1_sum"], tokens + sums["tokens"]
        return validation_metrics(nll, top1, tokens)

    def check_skipped_updates(self, metrics: dict[str, float]) -> None:
        """Count steps skipped for a non-finite loss or gradient norm; too many in a row stop the run."""
        skipped = metrics.get("train/skipped_updates", 0.0) > 0
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if skipped:
            logger.warning("step %d: update skipped for a non-finite loss or gradient norm", self.global_step)
        limit = self.cfg.worker.actor.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise TrainingError(
                f"step {self.global_step}: {self.consecutive_skips} consecutive updates skipped for non-finite values "
                "(see train/nonfinite_loss, train/nonfinite_grad_norm; worker.actor.max_consecutive_skips)"
            )

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "consecutive_skips": self.consecutive_skips,
            "sampler": self.sampler.state_dict(),
        }

    def restore_driver_state(self, state: dict[str, Any]) -> None:
        self.global_step = state["global_step"]
        self.consecutive_skips = state["consecutive_skips"]
        self.sampler.load_state_dict(state["sampler"])

    def trained_groups(self) -> list[tuple[str, Any]]:
        return [("actor", self.actor)]
