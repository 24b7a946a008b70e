"""Configuration of supervised fine-tuning (``sft.*``), and the checks `easyrl sft` runs on a config.

An SFT run reads the same sections as RL: ``data`` (files, `prompt_key`, `format_prompt`, the chat template and its
`chat_template_kwargs`, `shuffle`, `seed`, `val_batch_size`, `on_bad_row`), ``worker.actor`` (model, LoRA, optimizer,
FSDP, packing, token budget, Ulysses, micro-batch sizes; `global_batch_size` is the rows of one optimizer step) and
``trainer`` (length, resources, loggers, validation, checkpoints). This section holds what only SFT reads. A config
with an ``sft`` section is an SFT config: `easyrl check` checks it as one and `easyrl train` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from easyrl.config.errors import ConfigError


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig

OVERLONG_CHOICES = ("drop", "error")


@dataclass
class SFTConfig:
    messages_key: str = "messages"
    """Column holding a conversation: a list of `{role, content}` messages (`tool_calls` and `reasoning_content`
    are passed to the chat template as they are). Every assistant message trains. A row without this column is read
    as a `data.prompt_key` / `sft.response_key` pair."""
    tools_key: str = "tools"
    """Column holding the tool schemas of a conversation (a list, or its JSON text), handed to the chat template as
    `tools`; rows without it render with no tools."""
    response_key: str = "response"
    """With prompt/response rows: the column holding the assistant's answer. The prompt goes through
    `data.format_prompt` into one user message, as in RL."""
    max_length: int = 2048
    """Longest conversation in tokens (chat template included)."""
    overlong: str = "drop"
    """What a conversation longer than `max_length` does: `drop` (counted, like a bad row) or `error` (stop, naming
    the file and row). Conversations are never cut: a cut one would teach an answer without its end."""


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
    dp = workers // actor.ulysses_size  # `_check_sequence_parallel` ran: the split divides the workers
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
