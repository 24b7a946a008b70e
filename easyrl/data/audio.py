"""Audio inputs for the Omni thinkers (Qwen2.5-Omni, Qwen3-Omni MoE): loading, token counts, and the prompt encoding.

A row names its audio clips in ``data.audio_key`` (file paths relative to ``data.audio_dir``, or bytes). Each clip
is decoded with PyAV (any container and codec FFmpeg reads: wav, flac, mp3...), mixed down to mono and resampled to
the feature extractor's sampling rate (16 kHz for Qwen2.5-Omni), then turned into log-mel features by the model's
``WhisperFeatureExtractor``, padded to its window (30 s for the published model: a longer clip is cut there, as
transformers' Omni processor cuts it). The ``<|AUDIO|>`` token of the templated prompt becomes one token per
encoder output frame.

Where this departs from transformers' ``Qwen2_5OmniProcessor.__call__`` (and Qwen3-Omni's): the expansion of the audio and image
pads is done here (as :mod:`easyrl.data.multimodal` does for videos), because that processor cannot run without
its torchvision video processor; the arithmetic is the processor's (each family's, in :mod:`easyrl.models.family`). Videos (and audio inside videos) on an Omni
model are refused with one line: not built yet.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from easyrl.data.media import MediaRef
from easyrl.models.family import audio_output_tokens


__all__ = ["AudioError", "encode_omni_prompt", "load_audio", "omni_token_counts"]


class AudioError(ValueError):
    """An audio clip cannot be decoded or turned into model inputs."""


def load_audio(ref: MediaRef, sampling_rate: int) -> np.ndarray:
    """Decode ``ref`` (a path or the file's bytes) to mono float32 samples in [-1, 1] at ``sampling_rate`` Hz."""
    try:
        import av
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AudioError("decoding audio needs PyAV: pip install av") from exc
    where = ref if isinstance(ref, str) else f"<{len(ref)} bytes>"
    chunks: list[np.ndarray] = []
    try:
        opened: Any = av.open(ref if isinstance(ref, str) else io.BytesIO(ref))  # an input container: decodes
        with opened as container:
            if not container.streams.audio:
                raise AudioError(f"{where}: no audio stream")
            # FFmpeg's resampler converts the rate and keeps the channels (planar float32: (channels, n)); the mono
            # mix is their mean, as librosa's (what Qwen's own pipeline loads with), not FFmpeg's -3 dB downmix
            resampler = av.AudioResampler(format="fltp", rate=sampling_rate)
            for frame in container.decode(audio=0):
                chunks += [f.to_ndarray().mean(axis=0) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray().mean(axis=0) for f in resampler.resample(None)]  # what the resampler still holds
    except AudioError:
        raise
    except Exception as exc:  # PyAV raises its own error classes per FFmpeg error code
        raise AudioError(f"audio not decodable ({where}): {type(exc).__name__}: {exc}") from exc
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioError(f"{where}: the audio stream decodes to no samples")
    return samples


def _feature_frames(num_samples: int, features: Any) -> int:
    """Mel frames the feature extractor marks as real audio for a clip of ``num_samples`` samples: one per hop of
    the clip, cut at the extractor's window (``n_samples``)."""
    return -(-min(num_samples, int(features.n_samples)) // int(features.hop_length))


def _expand(text: str, token: str, counts: Sequence[int], what: str) -> str:
    pieces = text.split(token)
    if len(pieces) - 1 != len(counts):
        raise AudioError(f"the templated prompt has {len(pieces) - 1} {token} for {len(counts)} {what}")
    return pieces[0] + "".join(token * n + rest for n, rest in zip(counts, pieces[1:]))


def _image_tokens(spec: Any, grid: Sequence[int]) -> int:
    return int(grid[0]) * int(grid[1]) * int(grid[2]) // spec.merge_size**2


def encode_omni_prompt(
    processor: Any, text: str, images: Sequence[Image.Image], audios: Sequence[MediaRef], spec: Any
) -> dict[str, Any]:
    """Model inputs of one templated Omni prompt (one ``<|IMAGE|>`` per resized image, one ``<|AUDIO|>`` per clip).

    Returns ``input_ids`` (pads expanded), ``multi_modal_inputs`` (``pixel_values`` / ``image_grid_thw`` with
    images; ``input_features`` (n, mel bins, window frames) and ``feature_attention_mask`` (n, window frames) with
    audio), and the counts ``image_tokens`` / ``audio_tokens``."""
    features = processor.feature_extractor
    mm: dict[str, torch.Tensor] = {}
    audio_counts: list[int] = []
    if audios:
        clips = [load_audio(ref, int(features.sampling_rate)) for ref in audios]
        out = features(
            clips,
            sampling_rate=int(features.sampling_rate),
            padding="max_length",  # every clip padded to the window: samples' features then stack along dim 0
            return_attention_mask=True,
            return_tensors="pt",
        )
        mm["input_features"] = out["input_features"]
        mm["feature_attention_mask"] = out["attention_mask"].long()
        audio_counts = [int(n) for n in audio_output_tokens(mm["feature_attention_mask"].sum(-1), spec.family)]
    image_counts: list[int] = []
    if images:
        pixels = processor.image_processor(images=list(images), do_resize=False, return_tensors="pt")
        mm["pixel_values"] = pixels["pixel_values"]
        mm["image_grid_thw"] = pixels["image_grid_thw"].long()
        image_counts = [_image_tokens(spec, g) for g in mm["image_grid_thw"].tolist()]
    expanded = _expand(text, processor.audio_token, audio_counts, "audio clips")
    expanded = _expand(expanded, processor.image_token, image_counts, "images")
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return {
        "input_ids": list(ids),
        "multi_modal_inputs": mm,
        "image_tokens": sum(image_counts),
        "audio_tokens": sum(audio_counts),
    }


def omni_token_counts(
    processor: Any, text: str, audios: Sequence[MediaRef], family: str = "qwen2_5_omni"
) -> tuple[int, int]:
    """(audio tokens, text tokens of ``text`` with one pad per clip): each clip is decoded once to count its
    samples exactly (a container's duration can be off by a frame, which moves the count by a token)."""
    features = processor.feature_extractor
    audio_tokens = 0
    for ref in audios:
        frames = _feature_frames(load_audio(ref, int(features.sampling_rate)).size, features)
        audio_tokens += int(audio_output_tokens(frames, family))
    return audio_tokens, len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
