"""Prompt data: loading rows from local files, validation, prompt rendering, sampling and batching."""

from easyrl.data.collate import collate_prompts
from easyrl.data.dataset import BAD_ROW_REASONS, RLDataset
from easyrl.data.loading import SUPPORTED_EXTENSIONS, DataError, Row, load_rows
from easyrl.data.prompts import PromptRenderer, load_chat_template, load_prompt_template
from easyrl.data.sampler import PromptSampler


__all__ = [
    "BAD_ROW_REASONS",
    "SUPPORTED_EXTENSIONS",
    "DataError",
    "PromptRenderer",
    "PromptSampler",
    "RLDataset",
    "Row",
    "collate_prompts",
    "load_chat_template",
    "load_prompt_template",
    "load_rows",
]
