"""Configuration of supervised fine-tuning (``sft.*``), and the checks `easyrl sft` runs on a config.

An SFT run reads the same sections as RL: ``data`` (files, `prompt_key`, `format_prompt`, the chat template and its
`chat_template_kwargs`, `shuffle`, `seed`, `val_batch_size`, `on_bad_row`), ``worker.actor`` (model, LoRA, optimizer,
FSDP, packing, token budget, Ulysses, micro-batch sizes; `global_batch_size` is the rows of one optimizer step) and
``trainer`` (length, resources, loggers, validation, checkpoints). This section holds what only SFT reads. A config
with an ``sft`` section is an SFT config: `easyrl check` checks it as one (`easyrl.config.validate_sft`) and
`easyrl train` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass


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
