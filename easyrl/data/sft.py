"""Conversations for supervised fine-tuning: rows loaded, checked, rendered and tokenized once, at construction, with
the assistant tokens marked by the chat template (`easyrl.data.chat_spans`).

A row is a conversation (`sft.messages_key`, with `sft.tools_key` where present) or a prompt/response pair
(`data.prompt_key` through `data.format_prompt` into one user message, as in RL, and `sft.response_key` as the
assistant's answer). Each sample is laid out as the RL batch is, so the actor's forward head and update loop train it
unchanged: the tokens before the first trained one are the *prompt* (left-padded), the rest the *response*
(right-padded), whose `loss_mask` is 1 on the assistant tokens only (a multi-turn conversation's later user and tool
turns sit inside the response, attended and not trained, like tool output in a multi-turn rollout).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from easyrl.config.data import DataConfig
from easyrl.config.sft import SFTConfig
from easyrl.data.chat_spans import ChatRenderer, Conversation, SpanError, TemplateMaskError
from easyrl.data.length_bound import overlong_checker
from easyrl.data.loading import DataError, load_rows
from easyrl.data.prompts import PromptError, PromptRenderer, UnsafeTemplateError, load_chat_template


__all__ = ["SFT_DROP_REASONS", "SFTDataset", "collate_sft"]

logger = logging.getLogger(__name__)

SFT_DROP_REASONS: tuple[str, ...] = (
    "missing_messages",
    "bad_messages",
    "no_assistant_turn",
    "template_error",
    "overlong",
)
"""Keys of :attr:`SFTDataset.drop_counts`, in the order checks run (a row is counted under its first failure)."""


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class _Sample:
    source: str
    row_index: int
    prompt_ids: list[int]
    """The tokens before the first trained one (at least one: the first token is predicted by nothing)."""
    response_ids: list[int]
    loss_mask: list[int]
    """1 on the response tokens that train (the assistant's)."""


class SFTDataset:
    """Tokenized conversations for SFT training or validation.

    Args:
        spec: data files (see :func:`easyrl.data.loading.load_rows`), e.g. ``data.train_files``.
        data_cfg: the ``data`` config (prompt key and template, chat template and its kwargs, ``on_bad_row``).
        sft_cfg: the ``sft`` config (columns, ``max_length``, ``overlong``).
        tokenizer: the model's tokenizer.

    Raises:
        DataError: unreadable data, a bad row with ``on_bad_row=error``, an overlong one with ``overlong=error``, a
            chat template that cannot mark a row's assistant tokens, or no row left.
    """

    def __init__(self, spec: str, data_cfg: DataConfig, sft_cfg: SFTConfig, tokenizer: Any) -> None:
        self.spec, self.cfg, self.sft = spec, data_cfg, sft_cfg
        self.tokenizer = tokenizer
        try:
            chat_template = load_chat_template(data_cfg.override_chat_template)
            self.chat = ChatRenderer(tokenizer, chat_template, data_cfg.chat_template_kwargs)
            self._prompts = PromptRenderer(
                tokenizer, data_cfg.prompt_key, data_cfg.format_prompt, chat_template, data_cfg.chat_template_kwargs
            )
        except (OSError, ValueError) as exc:
            raise DataError(str(exc)) from exc
        self._cannot_fit = overlong_checker(tokenizer)
        rows = load_rows(spec)
        self.num_rows_read = len(rows)
        drops: Counter[str] = Counter()
        examples: dict[str, str] = {}
        self._samples: list[_Sample] = []
        for source, index, row in rows:
            try:
                self._samples.append(self._sample(source, index, row))
            except _BadRow as bad:
                where = f"{source}, row {index}"
                if data_cfg.on_bad_row == "error" or (bad.reason == "overlong" and sft_cfg.overlong == "error"):
                    raise DataError(f"{where}: {bad.reason}: {bad.detail}") from None
                drops[bad.reason] += 1
                examples.setdefault(bad.reason, f"{where}: {bad.detail}")
        self.drop_counts = {reason: drops[reason] for reason in SFT_DROP_REASONS if drops[reason]}
        """Rows dropped per reason (only reasons that occurred)."""
        self._log_summary(examples)
        if not self._samples:
            detail = ", ".join(f"{r}={n}" for r, n in self.drop_counts.items()) or "no rows read"
            raise DataError(f"{spec}: no usable conversations left out of {self.num_rows_read} ({detail})")

    # ------------------------------------------------------------------ building
    def _sample(self, source: str, index: int, row: dict[str, Any]) -> _Sample:
        media = self._media(row)
        if media is not None:
            raise DataError(f"{source}, row {index}: {media}")
        conv = self._conversation(row)
        self._refuse_unfit(conv)
        try:
            ids, mask = self.chat.encode(conv)
        except SpanError as exc:
            raise _BadRow("template_error", str(exc)) from exc
        except TemplateMaskError as exc:  # the template's, not the row's: stop whatever on_bad_row says
            raise DataError(f"{source}, row {index}: {exc}") from exc
        if len(ids) > self.sft.max_length:
            raise _BadRow(
                "overlong",
                f"the conversation has {len(ids)} tokens > sft.max_length={self.sft.max_length} (raise it, or "
                "sft.overlong=drop to leave such rows out)",
            )
        # The first token is predicted by nothing: a conversation whose first token is trained keeps it as the prompt.
        first = max(1, mask.index(1))
        return _Sample(source, index, ids[:first], ids[first:], mask[first:])

    def _media(self, row: dict[str, Any]) -> str | None:
        """Why the row cannot train as text, if it holds media: SFT renders text only, so a clip would be dropped
        without a word and an image part rendered as the template's placeholder text and trained on as such."""
        if row.get(self.cfg.audio_key):
            return (
                f"{self.cfg.audio_key!r} has audio, which SFT does not take yet (RL does, on an Omni thinker); drop "
                "the column or set data.audio_key to a column the rows lack"
            )
        for key, what in ((self.cfg.image_key, "image_key"), (self.cfg.video_key, "video_key")):
            if row.get(key):
                return (
                    f"{key!r} has media, which SFT does not take yet (RL does, on a vision-language model); drop the "
                    f"column or set data.{what} to a column the rows lack"
                )
        messages = row.get(self.sft.messages_key)
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                kind = _part_kind(part)
                if kind != "text":
                    return (
                        f"{self.sft.messages_key!r} message {i} has a content part of type {kind!r}, which SFT does "
                        "not take yet (the template would render its placeholder as text and train on it); drop the "
                        "part or the row"
                    )
        return None

    def _refuse_unfit(self, conv: Conversation) -> None:
        """An overlong row proven so before it is tokenized (a 10 MB message took 3.6 GB and seconds), as RL prompts
        are (`easyrl.data.length_bound`). Only a conversation whose fields alone pass `sft.max_length` characters is
        rendered for the proof; a smaller one is at most a template's markup longer, and is tokenized as before."""
        if self._cannot_fit is None:
            return
        limit = self.sft.max_length
        if len(json.dumps([conv.messages, conv.tools], ensure_ascii=False, default=str)) <= limit:
            return
        try:
            text = self.chat.render(conv)
        except SpanError as exc:
            raise _BadRow("template_error", str(exc)) from exc
        least = self._cannot_fit(text, limit)
        if least is not None:
            raise _BadRow(
                "overlong",
                f"the conversation has at least {least} tokens ({len(text)} characters, not tokenized) > "
                f"sft.max_length={limit} (raise it, or sft.overlong=drop to leave such rows out)",
            )

    def _conversation(self, row: dict[str, Any]) -> Conversation:
        """The row's messages and tools, or its prompt/response pair as a two-message conversation."""
        key = self.sft.messages_key
        if row.get(key) is not None:
            return Conversation(_checked_messages(row[key], key), _tools(row.get(self.sft.tools_key), self.sft))
        prompt_key, response_key = self.cfg.prompt_key, self.sft.response_key
        if row.get(prompt_key) is None or row.get(response_key) is None:
            raise _BadRow(
                "missing_messages",
                f"no {key!r} column, nor both {prompt_key!r} and {response_key!r} (columns: {sorted(row)}); set "
                "sft.messages_key, or data.prompt_key and sft.response_key, to the row's columns",
            )
        response = row[response_key]
        if not isinstance(response, str) or not response.strip():
            raise _BadRow("no_assistant_turn", f"{response_key!r} is not a non-empty string: nothing to train on")
        try:
            messages = self._prompts.messages(row)
        except PromptError as exc:
            raise _BadRow("template_error", str(exc)) from exc
        except UnsafeTemplateError as exc:  # the same for every row: stop
            raise DataError(str(exc)) from exc
        return Conversation([*messages, {"role": "assistant", "content": response}])

    def _log_summary(self, examples: dict[str, str]) -> None:
        dropped = sum(self.drop_counts.values())
        if not dropped:
            logger.info("%s: %d conversations loaded", self.spec, self.num_rows_read)
            return
        lines = [f"  {reason}: {count} (e.g. {examples[reason]})" for reason, count in self.drop_counts.items()]
        logger.warning(
            "%s: kept %d of %d rows, dropped %d:\n%s",
            self.spec,
            len(self._samples),
            self.num_rows_read,
            dropped,
            "\n".join(lines),
        )

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One conversation: ``prompt_ids``, ``response_ids`` and ``loss_mask`` (lists), and its ``index``."""
        s = self._samples[index]
        return {
            "prompt_ids": s.prompt_ids,
            "response_ids": s.response_ids,
            "loss_mask": s.loss_mask,
            "index": index,
        }

    def source_of(self, index: int) -> tuple[str, int]:
        """``(file, row_index)`` the sample at ``index`` came from."""
        return self._samples[index].source, self._samples[index].row_index

    def length_stats(self) -> dict[str, float]:
        """Tokens per conversation and trained tokens per conversation over the kept rows: min, mean, max, p95."""
        total = np.array([len(s.prompt_ids) + len(s.response_ids) for s in self._samples], dtype=np.float64)
        trained = np.array([sum(s.loss_mask) for s in self._samples], dtype=np.float64)
        stats = {f"tokens_{k}": v for k, v in _describe(total).items()}
        return stats | {f"trained_{k}": v for k, v in _describe(trained).items()}

    def marked_text(self, index: int) -> str:
        """The conversation at ``index`` as rendered, with every trained span between ``[[`` and ``]]``."""
        s = self._samples[index]
        ids, mask = s.prompt_ids + s.response_ids, [0] * len(s.prompt_ids) + s.loss_mask
        parts, start = [], 0
        for i in range(1, len(ids) + 1):  # runs of equal mask values
            if i == len(ids) or mask[i] != mask[start]:
                text = self.tokenizer.decode(ids[start:i], skip_special_tokens=False)
                parts.append(f"[[{text}]]" if mask[start] else text)
                start = i
        return "".join(parts)


def _describe(values: np.ndarray) -> dict[str, float]:
    return {
        "min": float(values.min()),
        "mean": float(values.mean()),
        "max": float(values.max()),
        "p95": float(np.percentile(values, 95)),
    }


def _checked_messages(messages: Any, key: str) -> list[dict[str, Any]]:
    """`messages` as the chat template takes them; raises `_BadRow` naming the message at fault."""
    if not isinstance(messages, list) or not messages:
        raise _BadRow("bad_messages", f"{key!r} is not a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _BadRow("bad_messages", f"{key!r} message {i} is not a {{'role', 'content'}} object")
        # Arrow (parquet, `datasets`) gives every message every field of the column's struct, unset ones as None;
        # templates test fields with `is defined` / `in message`, so the unset ones are dropped.
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _BadRow("bad_messages", f"{key!r} message {i} has content of type {type(content).__name__}")
        out.append(message)
    if not any(m["role"] == "assistant" and (m.get("content") or m.get("tool_calls")) for m in out):
        raise _BadRow(
            "no_assistant_turn",
            f"{key!r} has no assistant message with content or tool calls: nothing to train on (drop the row)",
        )
    return out


def _part_kind(part: Any) -> str:
    """A content part's kind: its `type`, else the media key it carries (`image`, `image_url`, ...), else text."""
    if not isinstance(part, dict):
        return "text"
    kind = part.get("type")
    if isinstance(kind, str) and kind:
        return kind
    return next((k for k in ("image", "image_url", "video", "audio", "input_audio") if part.get(k)), "text")


def _tools(value: Any, cfg: SFTConfig) -> list[dict[str, Any]] | None:
    """The row's tool schemas (a list, or its JSON text as parquet sets often store it), or None."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _BadRow("bad_messages", f"{cfg.tools_key!r} is text but not JSON: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _BadRow("bad_messages", f"{cfg.tools_key!r} is not a list of tool schemas (objects)")
    return value


def collate_sft(items: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Stack conversations as the RL batch lays out prompt and response: prompts left-padded to the longest of the
    batch, responses right-padded.

    Returns (B rows, P = longest prompt, R = longest response): ``input_ids``, ``attention_mask``, ``position_ids``
    (B, P + R); ``responses``, ``response_mask`` (every response token) and ``loss_mask`` (the trained ones) (B, R).
    """
    if not items:
        raise ValueError("collate_sft: empty batch")
    p = max(len(item["prompt_ids"]) for item in items)
    r = max(len(item["response_ids"]) for item in items)
    ids = torch.full((len(items), p + r), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(items), p + r), dtype=torch.long)
    loss_mask = torch.zeros((len(items), r), dtype=torch.long)
    for row, item in enumerate(items):
        prompt, response = item["prompt_ids"], item["response_ids"]
        ids[row, p - len(prompt) : p + len(response)] = torch.tensor([*prompt, *response], dtype=torch.long)
        mask[row, p - len(prompt) : p + len(response)] = 1
        loss_mask[row, : len(response)] = torch.tensor(item["loss_mask"], dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        # positions count real tokens only; padding gets 0 (masked out anyway)
        "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": ids[:, p:],
        "response_mask": mask[:, p:].clone(),
        "loss_mask": loss_mask,
    }
