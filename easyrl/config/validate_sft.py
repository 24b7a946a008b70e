"""The checks `easyrl sft` runs on a config: the `sft` section and the batch arithmetic of an SFT run.

Apart from `easyrl.config.sft` (the section's dataclass, which the root config `schema.py` holds), because they read
the whole config: the section itself never imports the root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from easyrl.config.errors import ConfigError
from easyrl.config.sft import OVERLONG_CHOICES


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig


def check_sft(cfg: EasyRLConfig) -> None:
    """The `sft` section and the batch arithmetic of an SFT run: one optimizer step per step, over
    `worker.actor.global_batch_size` rows split over the data-parallel groups."""
    sft, actor = cfg.sft, cfg.worker.actor
    for key in ("messages_key", "tools_key", "response_key"):
        if not getattr(sft, key):
            raise ConfigError(f"sft.{key}", "is empty: name the column")
    if not isinstance(sft.max_length, int) or sft.max_length < 2:
        raise ConfigError("sft.max_length", f"must be an integer >= 2 (tokens), got {sft.max_length!r}")
    if sft.overlong not in OVERLONG_CHOICES:
        raise ConfigError("sft.overlong", f"{sft.overlong!r} is not allowed; choose one of: drop, error")
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    dp = workers // actor.sp_size  # `_check_sequence_parallel` ran: the split divides the workers
    if actor.global_batch_size % dp:
        raise ConfigError(
            "worker.actor.global_batch_size",
            f"{actor.global_batch_size} rows per optimizer step must divide evenly over {dp} data-parallel workers",
        )
    per_worker = actor.global_batch_size // dp
    if not actor.dynamic_batching and per_worker % actor.micro_batch_size_per_device_for_update:
        raise ConfigError(
            "worker.actor.micro_batch_size_per_device_for_update",
            f"{actor.micro_batch_size_per_device_for_update} must divide the {per_worker} rows each worker trains "
            f"per optimizer step (worker.actor.global_batch_size / {dp} workers)",
        )
    if actor.ppo_epochs != 1:
        raise ConfigError("worker.actor.ppo_epochs", "is an RL key; SFT makes one pass per step: leave it at 1")
