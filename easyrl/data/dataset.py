"""The prompt dataset: rows loaded, validated, rendered and tokenized once, at construction.

Everything that can go wrong with a row (a missing column, a wrong type, an unreadable image, a prompt that is too
long) is found here, before the first training step, and either counted and dropped (``data.on_bad_row=drop``) or
reported with the file and row (``error``). Nothing is validated lazily in ``__getitem__``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from easyrl.config.data import DataConfig
from easyrl.data.length_bound import overlong_checker
from easyrl.data.loading import DataError, Row, load_rows
from easyrl.data.media import MediaError, MediaRef, resolve_audios, resolve_images, resolve_videos
from easyrl.data.multimodal import MediaTokenCounts, MultimodalError, encode_multimodal_prompt, media_token_counts
from easyrl.data.prompts import (
    PromptError,
    PromptRenderer,
    UnsafeTemplateError,
    check_messages,
    load_chat_template,
)


__all__ = ["BAD_ROW_REASONS", "RLDataset"]

logger = logging.getLogger(__name__)

BAD_ROW_REASONS: tuple[str, ...] = (
    "missing_prompt",
    "missing_answer",
    "bad_prompt_type",
    "empty_prompt",
    "bad_answer_type",
    "unreadable_image",
    "unreadable_video",
    "unreadable_audio",
    "template_error",
    "bad_media",
    "overlong_prompt",
)
"""Keys of :attr:`RLDataset.drop_counts`, in the order checks run (a row is counted under its first failure)."""

_ANSWER_TYPES = (str, int, float, list, dict)
_TOKENIZE_CHUNK = 1024  # rows tokenized per call: fast tokenizers parallelise within a batch


class _BadRow(Exception):
    """Internal: a row failed a check; ``reason`` is one of BAD_ROW_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class _Sample:
    source: str
    row_index: int
    row: dict[str, Any]
    ground_truth: Any
    raw_prompt: str
    images: list[MediaRef] = field(default_factory=list)
    videos: list[MediaRef] = field(default_factory=list)
    audios: list[MediaRef] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    media: MediaTokenCounts | None = None
    """Token counts with the media expanded (rows with media and a processor only)."""


class RLDataset:
    """Prompts for RL training or validation.

    Args:
        spec: data files (see :func:`easyrl.data.loading.load_rows`), e.g. ``data.train_files``.
        data_cfg: the ``data`` config (keys, templates, lengths, ``on_bad_row``...).
        tokenizer: Hugging Face tokenizer used to apply the chat template and tokenize.
        processor: optional multimodal processor; its chat template is used when it has one. Media tokens are
            counted in prompt lengths (see :mod:`easyrl.data.multimodal`).
        rollout_media: also give each item with media a ``rollout_prompt`` for engines that process pixels
            themselves (vLLM): its token ids before the media expansion and the very images and video frames the
            actor's patches are cut from (see :meth:`__getitem__`).

    Raises:
        DataError: unreadable data, a bad row with ``on_bad_row=error``, an overlong prompt with
            ``filter_overlong_prompts=false``, or no row left.
    """

    def __init__(
        self, spec: str, data_cfg: DataConfig, tokenizer: Any, processor: Any = None, rollout_media: bool = False
    ) -> None:
        if data_cfg.on_bad_row not in ("drop", "error"):
            raise DataError(f"data.on_bad_row must be 'drop' or 'error', got {data_cfg.on_bad_row!r}")
        self.spec = spec
        self.cfg = data_cfg
        self.tokenizer: Any = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)
        if self.tokenizer is None:
            raise DataError("RLDataset needs a tokenizer (or a processor with one)")
        self.processor = processor
        self.rollout_media = rollout_media
        try:
            chat_template = load_chat_template(data_cfg.override_chat_template)
            # The processor's template if it has one (a VL template renders image / video parts), else the tokenizer's.
            templater = processor if getattr(processor, "chat_template", None) else self.tokenizer
            self._renderer = PromptRenderer(
                templater, data_cfg.prompt_key, data_cfg.format_prompt, chat_template, data_cfg.chat_template_kwargs
            )
        except (OSError, ValueError) as exc:
            raise DataError(str(exc)) from exc
        self.drop_counts: dict[str, int] = {}
        """Rows dropped per reason (only reasons that occurred)."""
        self.num_rows_read = 0
        """Rows read from the files, before validation."""
        self._image_cache: dict[str, str | None] = {}
        # Rows that can never fit are dropped before they are tokenized (a 10 MB row took gigabytes and seconds).
        self._cannot_fit = overlong_checker(self.tokenizer)
        self._samples = self._build(load_rows(spec))

    # ------------------------------------------------------------------ building

    def _build(self, rows: list[Row]) -> list[_Sample]:
        self.num_rows_read = len(rows)
        drops: Counter[str] = Counter()
        examples: dict[str, str] = {}
        samples: list[_Sample] = []
        for source, row_index, row in rows:
            try:
                samples.append(self._prepare(source, row_index, row))
            except _BadRow as bad:
                self._reject(bad, source, row_index, drops, examples)
        samples = self._tokenize(samples, drops, examples)
        self.drop_counts = {reason: drops[reason] for reason in BAD_ROW_REASONS if drops[reason]}
        self._log_summary(examples)
        if not samples:
            detail = ", ".join(f"{reason}={count}" for reason, count in self.drop_counts.items()) or "no rows read"
            raise DataError(f"{self.spec}: no usable rows left out of {self.num_rows_read} ({detail})")
        return samples

    def _reject(
        self, bad: _BadRow, source: str, row_index: int, drops: Counter[str], examples: dict[str, str]
    ) -> None:
        where = f"{source}, row {row_index}"
        if self.cfg.on_bad_row == "error":
            raise DataError(f"{where}: {bad.reason}: {bad.detail}")
        drops[bad.reason] += 1
        examples.setdefault(bad.reason, f"{where}: {bad.detail}")  # the first row of each reason, for the summary

    def _prepare(self, source: str, row_index: int, row: dict[str, Any]) -> _Sample:
        """Validate one row and render its prompt; raise :class:`_BadRow` on the first problem."""
        cfg = self.cfg
        prompt = row.get(cfg.prompt_key)
        if prompt is None:
            raise _BadRow("missing_prompt", f"no {cfg.prompt_key!r} column (columns: {sorted(row)})")
        answer = row.get(cfg.answer_key)
        # CSV leaves missing cells as "" and pandas-made parquet as NaN: both mean "no answer".
        if answer is None or (isinstance(answer, str) and not answer.strip()) or _is_nan(answer):
            raise _BadRow("missing_answer", f"no value in the {cfg.answer_key!r} column")
        if not isinstance(prompt, str | list):
            raise _BadRow("bad_prompt_type", f"{cfg.prompt_key!r} is a {type(prompt).__name__}, expected str or list")
        if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
            raise _BadRow("empty_prompt", f"{cfg.prompt_key!r} is empty")
        if isinstance(prompt, list):
            try:
                check_messages(prompt)
            except PromptError as exc:
                raise _BadRow("bad_prompt_type", str(exc)) from exc
        # bool is an int subclass, but a true/false "answer" is almost always a data mistake.
        if isinstance(answer, bool) or not isinstance(answer, _ANSWER_TYPES):
            raise _BadRow("bad_answer_type", f"{cfg.answer_key!r} is a {type(answer).__name__}")
        try:
            images = resolve_images(row.get(cfg.image_key), cfg.image_dir, self._image_cache)
        except MediaError as exc:
            raise _BadRow("unreadable_image", str(exc)) from exc
        try:
            videos = resolve_videos(row.get(cfg.video_key), cfg.video_dir)
        except MediaError as exc:
            raise _BadRow("unreadable_video", str(exc)) from exc
        try:
            audios = resolve_audios(row.get(cfg.audio_key), cfg.audio_dir)
        except MediaError as exc:
            raise _BadRow("unreadable_audio", str(exc)) from exc
        if audios and self.processor is None:  # a text model would train on the prompt without its audio
            raise _BadRow(
                "bad_media",
                f"{cfg.audio_key!r} has audio clips but the model has no processor (an Omni model takes them)",
            )
        try:
            raw_prompt = self._renderer.render(row)
        except PromptError as exc:
            raise _BadRow("template_error", str(exc)) from exc
        except UnsafeTemplateError as exc:  # the same for every row: stop, never count it as a bad row
            raise DataError(str(exc)) from exc
        least = self._cannot_fit(raw_prompt, cfg.max_prompt_length) if self._cannot_fit is not None else None
        if least is not None:
            detail = f"prompt has at least {least} tokens ({len(raw_prompt)} characters, not tokenized)"
            raise self._overlong(source, row_index, f"{detail} > data.max_prompt_length={cfg.max_prompt_length}")
        sample = _Sample(source, row_index, row, answer, raw_prompt, images, videos, audios)
        if self.processor is not None and (images or videos or audios):
            try:
                sample.media = media_token_counts(
                    self.processor,
                    self._renderer.messages(row),
                    images,
                    videos,
                    cfg,
                    self._renderer.chat_template,
                    self._renderer.template_kwargs,
                    audios,
                )
            except (MultimodalError, MediaError, OSError) as exc:
                raise _BadRow("bad_media", str(exc)) from exc
        return sample

    def _tokenize(self, samples: list[_Sample], drops: Counter[str], examples: dict[str, str]) -> list[_Sample]:
        limit = self.cfg.max_prompt_length
        kept: list[_Sample] = []
        for start in range(0, len(samples), _TOKENIZE_CHUNK):
            chunk = samples[start : start + _TOKENIZE_CHUNK]
            # The chat template already placed every special token, so the tokenizer must not add its own.
            encoded = self.tokenizer([s.raw_prompt for s in chunk], add_special_tokens=False)["input_ids"]
            for sample, ids in zip(chunk, encoded):
                sample.prompt_ids = list(ids)
                length = _prompt_length(sample)
                if length <= limit:
                    kept.append(sample)
                    continue
                media = " (media included)" if sample.media is not None else ""
                detail = f"prompt has {length} tokens{media} > data.max_prompt_length={limit}"
                # raises instead with filter_overlong_prompts off
                bad = self._overlong(sample.source, sample.row_index, detail)
                self._reject(bad, sample.source, sample.row_index, drops, examples)
        return kept

    def _overlong(self, source: str, row_index: int, detail: str) -> _BadRow:
        """The bad row to drop, or (with `data.filter_overlong_prompts=false`) the error that stops loading."""
        if not self.cfg.filter_overlong_prompts:
            raise DataError(
                f"{source}, row {row_index}: overlong_prompt: {detail} "
                "(set data.filter_overlong_prompts=true to drop such rows)"
            )
        return _BadRow("overlong_prompt", detail)

    def _log_summary(self, examples: dict[str, str]) -> None:
        dropped = sum(self.drop_counts.values())
        if not dropped:
            logger.info("%s: %d rows loaded", self.spec, self.num_rows_read)
            return
        lines = [f"  {reason}: {count} (e.g. {examples[reason]})" for reason, count in self.drop_counts.items()]
        logger.warning(
            "%s: kept %d of %d rows, dropped %d:\n%s",
            self.spec,
            self.num_rows_read - dropped,
            self.num_rows_read,
            dropped,
            "\n".join(lines),
        )

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return len(self._samples)

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Each kept row with where it came from (`file, row N`), for checks over the whole data at load."""
        return [(f"{s.source}, row {s.row_index}", s.row) for s in self._samples]

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One prompt: ``prompt_ids`` (unpadded), ``raw_prompt``, ``ground_truth``, ``row``, ``index``, plus the
        resolved ``images`` / ``videos`` (paths or bytes; empty lists when the row has none). With a processor also
        ``multi_modal_inputs`` (the actor's pixel patches and grids; ``prompt_ids`` then have the media expanded),
        and with ``rollout_media`` a ``rollout_prompt`` (``{}`` for a row without media)."""
        sample = self._samples[index]
        item: dict[str, Any] = {
            "prompt_ids": list(sample.prompt_ids),
            "raw_prompt": sample.raw_prompt,
            "ground_truth": sample.ground_truth,
            "row": sample.row,
            "index": index,
            "images": list(sample.images),
            "videos": list(sample.videos),
            "audios": list(sample.audios),
        }
        if self.processor is not None:
            # Pixels are decoded here, per batch; the prompt ids get one pad token per merged patch.
            item["multi_modal_inputs"] = {}
            if sample.images or sample.videos or sample.audios:
                encoded = encode_multimodal_prompt(
                    self.processor,
                    self._renderer.messages(sample.row),
                    sample.images,
                    sample.videos,
                    self.cfg,
                    self._renderer.chat_template,
                    self._renderer.template_kwargs,
                    sample.audios,
                )
                item["prompt_ids"] = encoded["input_ids"]  # media expanded: the pads the actor's patches fill
                item["multi_modal_inputs"] = encoded["multi_modal_inputs"]
                if self.rollout_media:
                    item["rollout_prompt"] = _rollout_prompt(self.tokenizer, encoded)
            if self.rollout_media:
                # text rows too: collate keeps a column only when all items have it
                item.setdefault("rollout_prompt", {})
        return item

    def media_per_row(self) -> dict[str, int]:
        """The most images and the most videos (and audio clips, when a row has one) any kept row has (what an
        engine must accept per prompt)."""
        most = {
            "image": max((len(s.images) for s in self._samples), default=0),
            "video": max((len(s.videos) for s in self._samples), default=0),
        }
        audio = max((len(s.audios) for s in self._samples), default=0)
        return most | {"audio": audio} if audio else most  # a VL engine knows no audio modality, not even at 0

    def source_of(self, index: int) -> tuple[str, int]:
        """``(file, row_index)`` the sample at ``index`` came from."""
        sample = self._samples[index]
        return sample.source, sample.row_index

    def media_token_stats(self) -> dict[str, float]:
        """Image/video tokens per row over the kept rows that carry media (empty without media or processor)."""
        counts = [s.media for s in self._samples if s.media is not None]
        if not counts:
            return {}
        per_row = np.array([c.image_tokens + c.video_tokens + c.audio_tokens for c in counts])
        audios = sum(c.audios for c in counts)
        return {
            "rows_with_media": float(len(counts)),
            "images": float(sum(c.images for c in counts)),
            "videos": float(sum(c.videos for c in counts)),
            **({"audio_clips": float(audios)} if audios else {}),
            "media_tokens_min": float(per_row.min()),
            "media_tokens_mean": float(per_row.mean()),
            "media_tokens_max": float(per_row.max()),
        }

    def prompt_length_stats(self) -> dict[str, float]:
        """Token lengths of the kept prompts: ``min``, ``mean``, ``max`` and ``p95``."""
        # the length the overlong filter measured: media tokens counted as the model sees them
        lengths = np.array([_prompt_length(s) for s in self._samples], dtype=np.float64)
        return {
            "min": float(lengths.min()),
            "mean": float(lengths.mean()),
            "max": float(lengths.max()),
            "p95": float(np.percentile(lengths, 95)),
        }


def _prompt_length(sample: _Sample) -> int:
    """The prompt's length in tokens as the model sees it: with media, the text's tokens plus each image's and
    video's expanded tokens (`media_token_counts`; `prompt_ids` holds one pad per image there), else its ids."""
    return sample.media.prompt_tokens if sample.media is not None else len(sample.prompt_ids)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _rollout_prompt(tokenizer: Any, encoded: dict[str, Any]) -> dict[str, Any]:
    """What an engine that processes pixels itself gets for one prompt with media, in vLLM's ``TokensPrompt`` shape:
    the templated prompt's ids with one pad token per image / video (the engine expands them again from the pixels)
    and the media as uint8 arrays (small to ship to the workers): the resized images, and per video its sampled
    resized frames with their :meth:`VideoClip.metadata`."""
    # The templated text before expansion: one pad per image / video, which vLLM expands itself.
    ids = tokenizer(encoded["prompt"], add_special_tokens=False)["input_ids"]
    media: dict[str, Any] = {}
    if encoded["images"]:
        media["image"] = [np.asarray(img) for img in encoded["images"]]
    if encoded["videos"]:
        media["video"] = list(encoded["videos"])
    return {"prompt_token_ids": list(ids), "multi_modal_data": media}
