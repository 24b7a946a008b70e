"""Turning a row's images and videos into Qwen-VL model inputs.

For one dataset item (``RLDataset[i]``: the row, and its ``images`` / ``videos`` resolved to paths or bytes) this
module

* loads each image with Pillow (RGB) and resizes it, keeping the aspect ratio, to sides that are multiples of
  ``patch_size * merge_size`` and an area within ``data.min_pixels``..``data.max_pixels``;
* decodes videos with PyAV and samples ``data.video_fps`` frames per second (at most ``data.max_frames``, a multiple
  of the temporal patch), resized like images with the pixel budget shared by the frames;
* places image/video parts where the ``<image>`` / ``<video>`` placeholders are in the prompt text (or, with no
  placeholders, before the text of the first user message);
* runs the processor: chat template, image patches, and the expansion of each ``<|image_pad|>`` into one token per
  merged patch. Video patches and their ``<|video_pad|>`` expansion (with Qwen3-VL's per-frame timestamps) are done
  here, because transformers' video processors need torchvision.

:func:`media_token_counts` gives the same token counts from image sizes and video metadata alone, for
``easyrl check`` and the dataset's overlong filter: a prompt whose media tokens push it past
``data.max_prompt_length`` would be truncated and fail with "Image features and image tokens do not match".
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from easyrl.data.media import MediaRef
from easyrl.models.processor import VisionSpec, vision_spec


__all__ = [
    "MediaTokenCounts",
    "MultimodalError",
    "VideoClip",
    "encode_multimodal_prompt",
    "fit_image",
    "load_image",
    "load_video",
    "media_messages",
    "media_token_counts",
    "patchify_frames",
    "sample_frame_indices",
    "smart_resize",
]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
_PLACEHOLDERS = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video", AUDIO_PLACEHOLDER: "audio"}
_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(p) for p in _PLACEHOLDERS) + ")")


class MultimodalError(ValueError):
    """A row's media cannot be turned into model inputs (too many images, placeholders that do not match...)."""


# ---------------------------------------------------------------------------------------------- images


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) closest to the input whose sides are multiples of ``factor`` and whose area is within
    ``[min_pixels, max_pixels]``, keeping the aspect ratio (up to rounding to ``factor``)."""
    if height <= 0 or width <= 0:
        raise MultimodalError(f"empty image ({width}x{height})")
    if max(height, width) / min(height, width) > 200:  # the Qwen-VL image processor's own limit
        raise MultimodalError(f"image aspect ratio {width}x{height} is beyond 200:1")
    # The arithmetic of transformers' Qwen2-VL smart_resize, plus a floor of one factor per side.
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        # One scale for both sides keeps the aspect ratio; rounding down keeps the area within max_pixels, rounding up
        # (below) reaches min_pixels.
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def load_image(ref: MediaRef | Image.Image) -> Image.Image:
    """Decode an image path or bytes (or take a PIL image) as RGB."""
    if isinstance(ref, Image.Image):
        image = ref
    else:
        image = Image.open(ref if isinstance(ref, str) else io.BytesIO(ref))
        image.load()  # decode now: Image.open is lazy and would read the file or buffer later
    return image.convert("RGB") if image.mode != "RGB" else image


def fit_image(image: Image.Image, spec: VisionSpec, min_pixels: int, max_pixels: int) -> Image.Image:
    """``image`` resized (bicubic) to the :func:`smart_resize` size; unchanged when it already fits."""
    h, w = smart_resize(image.height, image.width, spec.factor, min_pixels, max_pixels)
    return image if (h, w) == (image.height, image.width) else image.resize((w, h), Image.Resampling.BICUBIC)


def _image_size(ref: MediaRef | Image.Image) -> tuple[int, int]:
    """(height, width) without decoding the pixels."""
    if isinstance(ref, Image.Image):
        return ref.height, ref.width
    with Image.open(ref if isinstance(ref, str) else io.BytesIO(ref)) as image:  # lazy: reads the header only
        return image.height, image.width


# ---------------------------------------------------------------------------------------------- videos


@dataclass
class VideoClip:
    """Frames sampled from a video, resized to one common size."""

    frames: np.ndarray
    """(T, H, W, 3) uint8; T is a multiple of the temporal patch size."""
    indices: list[int]
    """Index in the source video of each frame."""
    native_fps: float
    sampled_fps: float
    """Frames per second of the sample (T over the video's duration)."""
    total_frames: int
    """Frames in the source video."""

    def metadata(self) -> dict[str, Any]:
        """The clip described with transformers' ``VideoMetadata`` fields: an engine that runs the model's own video
        processor (vLLM) derives the same seconds per temporal patch and Qwen3-VL timestamps from it as we do."""
        return {
            "fps": self.native_fps,
            "duration": self.total_frames / self.native_fps,
            "total_num_frames": self.total_frames,
            "frames_indices": list(self.indices),
            "height": int(self.frames.shape[1]),
            "width": int(self.frames.shape[2]),
            "video_backend": "pyav",
        }


def sample_frame_indices(
    total_frames: int, native_fps: float, video_fps: float, max_frames: int, temporal_patch_size: int = 2
) -> list[int]:
    """Evenly spaced frame indices: ``video_fps`` per second of video, at most ``max_frames``, at least one temporal
    patch, and a multiple of ``temporal_patch_size`` (frames repeat when the video is shorter than that)."""
    if total_frames <= 0:
        raise MultimodalError("video has no frames")
    duration = total_frames / native_fps if native_fps > 0 else float(total_frames)  # unknown fps: a frame a second
    wanted = round(duration * video_fps)
    # whole temporal patches, at least one
    cap = max(temporal_patch_size, max_frames - max_frames % temporal_patch_size)
    # No more frames than the video has, except to fill one temporal patch (indices then repeat).
    count = min(max(wanted, temporal_patch_size), cap, max(total_frames, temporal_patch_size))
    count = max(temporal_patch_size, count - count % temporal_patch_size)
    return [int(x) for x in np.rint(np.linspace(0, total_frames - 1, count))]  # first and last frame included


def _open_container(ref: MediaRef) -> Any:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MultimodalError("decoding videos needs PyAV: pip install av") from exc
    return av.open(ref if isinstance(ref, str) else io.BytesIO(ref))


def _video_meta(ref: MediaRef) -> tuple[int, float, int, int]:
    """(frame count, fps, height, width) from the container, decoding frames only when the count is unknown."""
    with _open_container(ref) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
        height, width = int(stream.codec_context.height), int(stream.codec_context.width)
        total = int(stream.frames or 0)  # 0 when the container does not record it
        if total <= 0:
            total = sum(1 for _ in container.decode(video=0))
    return total, fps, height, width


def _frame_budget(min_pixels: int, max_pixels: int, num_frames: int, spec: VisionSpec) -> tuple[int, int]:
    """Per-frame (min, max) pixels: ``max_pixels`` is shared by the temporal patches of the clip."""
    groups = max(1, num_frames // spec.temporal_patch_size)
    frame_max = max(spec.factor**2, max_pixels // groups)  # never below one merged patch
    return min(min_pixels, frame_max), frame_max  # min never above max


def load_video(ref: MediaRef, spec: VisionSpec, data_cfg: Any) -> VideoClip:
    """Decode ``ref`` with PyAV, sample frames (``data_cfg.video_fps``, ``max_frames``) and resize them.

    Streaming: frames are decoded one at a time and each sampled one is resized into its slot of the output as it is
    read, so a clip of thousands of frames holds the sampled frames, at their final size, and one decoded frame."""
    total, fps, height, width = _video_meta(ref)
    indices = sample_frame_indices(total, fps, data_cfg.video_fps, data_cfg.max_frames, spec.temporal_patch_size)
    lo, hi = _frame_budget(data_cfg.min_pixels, data_cfg.max_pixels, len(indices), spec)
    h, w = smart_resize(height, width, spec.factor, lo, hi)
    slots: dict[int, list[int]] = {}  # source frame -> its positions in the clip (a short video repeats frames)
    for pos, i in enumerate(indices):
        slots.setdefault(i, []).append(pos)
    frames = np.empty((len(indices), h, w, 3), dtype=np.uint8)
    filled = -1  # the last clip position written
    with _open_container(ref) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in slots:
                image = frame.to_image().convert("RGB")
                frames[slots[i]] = np.asarray(image.resize((w, h), Image.Resampling.BICUBIC), dtype=np.uint8)
                filled = slots[i][-1]
            if i >= indices[-1]:  # indices ascend: nothing wanted after the last
                break
    if filled < 0:
        raise MultimodalError("no frame could be decoded")
    # The container's frame count can exceed what decodes: missing frames repeat the last decoded one.
    frames[filled + 1 :] = frames[filled]
    duration = total / fps
    return VideoClip(frames, indices, fps, len(indices) / duration if duration > 0 else fps, total)


def patchify_frames(frames: np.ndarray, spec: VisionSpec) -> tuple[torch.Tensor, list[int]]:
    """(T, H, W, 3) uint8 frames -> (grid_t * grid_h * grid_w, 3 * tps * p * p) float patches and [t, h, w].

    Same layout as the Qwen2-VL image processor (merge-window major, then channel, time, row, column), with the
    time axis filled by consecutive frames instead of a repeated image.
    """
    t_patch, patch, merge = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    num, height, width, _ = frames.shape
    if num % t_patch or height % (patch * merge) or width % (patch * merge):
        raise MultimodalError(f"frames {frames.shape} do not tile into {t_patch}x{patch * merge} patches")
    x: Any = frames.astype(np.float32) / 255.0
    # Rescaled to [0, 1] and normalized, as the image processor does.
    x = (x - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    x = x.transpose(0, 3, 1, 2)  # T, C, H, W
    gt, gh, gw = num // t_patch, height // patch, width // patch
    x = x.reshape(gt, t_patch, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, gh/m, gw/m, mh, mw, C, tp, ph, pw
    patches = np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * t_patch * patch * patch)
    return torch.from_numpy(patches), [gt, gh, gw]


def _video_placeholder(spec: VisionSpec, grid: Sequence[int], clip_times: list[float] | None) -> str:
    """The text replacing one ``<|video_pad|>``: one pad per merged patch; Qwen3-VL adds per-frame timestamps."""
    per_frame = grid[1] * grid[2] // spec.merge_size**2  # merged patches per temporal patch
    if not spec.media.frame_timestamps:
        return spec.video_token * (grid[0] * per_frame)
    times = clip_times or [float(i) for i in range(grid[0])]  # no timestamps given: a second per temporal patch
    return "".join(
        f"<{times[i]:.1f} seconds>{spec.vision_start}{spec.video_token * per_frame}{spec.vision_end}"
        for i in range(grid[0])
    )


def _frame_times(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Mean timestamp (s) of the frames of each temporal patch (Qwen3-VL's convention)."""
    times = [i / fps for i in indices]
    return [(times[k] + times[k + temporal_patch_size - 1]) / 2 for k in range(0, len(times), temporal_patch_size)]


# ---------------------------------------------------------------------------------------------- messages


def media_messages(
    messages: list[dict[str, Any]], num_images: int, num_videos: int, num_audios: int = 0
) -> list[dict[str, Any]]:
    """``messages`` with ``<image>`` / ``<video>`` / ``<audio>`` placeholders in string contents turned into
    image/video/audio parts.

    With no placeholder at all, the media parts (images, then videos, then audio clips) are put before the text of
    the first user message. Contents that are already part lists are kept. The placeholder counts must match the
    media counts.
    """
    out: list[dict[str, Any]] = []
    seen = {"image": 0, "video": 0, "audio": 0}
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            for part in content:
                if isinstance(part, dict) and part.get("type") in seen:
                    seen[part["type"]] += 1
            out.append(dict(message))  # a copy: the caller's messages stay as they are
            continue
        parts: list[dict[str, Any]] = []
        for piece in _PLACEHOLDER_RE.split(content):
            if piece in _PLACEHOLDERS:
                kind = _PLACEHOLDERS[piece]
                seen[kind] += 1
                parts.append({"type": kind})
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    if not any(seen.values()) and (num_images or num_videos or num_audios):
        target = next((m for m in out if m["role"] == "user"), None)
        if target is None:
            raise MultimodalError("the prompt has media but no user message to put them in")
        media = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "audio"}] * num_audios
        target["content"] = media + list(target["content"])
        return out
    if (seen["image"], seen["video"], seen["audio"]) != (num_images, num_videos, num_audios):
        raise MultimodalError(
            f"the prompt has {seen['image']} {IMAGE_PLACEHOLDER}, {seen['video']} {VIDEO_PLACEHOLDER} and "
            f"{seen['audio']} {AUDIO_PLACEHOLDER} placeholders for {num_images} images, {num_videos} videos and "
            f"{num_audios} audio clips"
        )
    return out


def _render(
    processor: Any, messages: list[dict[str, Any]], chat_template: str | None, template_kwargs: dict[str, Any] | None
) -> str:
    text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=chat_template, **(template_kwargs or {})
    )
    if not isinstance(text, str):
        raise MultimodalError(f"chat template returned {type(text).__name__}, expected text")
    return text


def _expand_videos(text: str, token: str, placeholders: list[str]) -> str:
    pieces = text.split(token)
    if len(pieces) - 1 != len(placeholders):
        raise MultimodalError(f"the templated prompt has {len(pieces) - 1} {token} for {len(placeholders)} videos")
    # the i-th video's tokens replace the i-th pad
    return pieces[0] + "".join(p + rest for p, rest in zip(placeholders, pieces[1:]))


def _check_audio(spec: VisionSpec, videos: Sequence[Any], audios: Sequence[Any]) -> None:
    """Audio needs an Omni model; an Omni model's videos are not built yet: one line each."""
    if audios and not spec.media.takes_audio:
        raise MultimodalError(
            f"the row has {len(audios)} audio clips but the model's processor ({spec.family}) takes images and "
            "videos only: use an Omni thinker (Qwen2.5-Omni, Qwen3-Omni MoE) or drop data.audio_key's column"
        )
    if videos and not spec.media.videos:
        raise MultimodalError(
            "videos on an Omni model are not supported yet (its video pads interleave with the audio track): drop "
            "data.video_key's column, or give the frames as images"
        )


def _check_limit(images: Sequence[Any], data_cfg: Any) -> None:
    limit = int(getattr(data_cfg, "limit_images", 0) or 0)
    if limit > 0 and len(images) > limit:
        raise MultimodalError(f"{len(images)} images > data.limit_images={limit}")


# ---------------------------------------------------------------------------------------------- encoding


def _encode_videos(
    text: str, videos: Sequence[MediaRef], spec: VisionSpec, data_cfg: Any
) -> tuple[str, dict[str, torch.Tensor], int, list[VideoClip]]:
    """(``text`` with each video pad expanded, the videos' model inputs, their token count, the sampled clips)."""
    mm: dict[str, torch.Tensor] = {}
    expanded = text
    video_tokens = 0
    clips: list[VideoClip] = []
    if videos:
        patches, grids, placeholders, seconds = [], [], [], []
        for ref in videos:
            clip = load_video(ref, spec, data_cfg)
            clips.append(clip)
            pv, grid = patchify_frames(clip.frames, spec)
            patches.append(pv)
            grids.append(grid)
            times = _frame_times(clip.indices, clip.native_fps, spec.temporal_patch_size)
            placeholders.append(_video_placeholder(spec, grid, times))
            # seconds per temporal patch (Qwen2.5-VL's second_per_grid_ts)
            seconds.append(spec.temporal_patch_size / clip.sampled_fps)
            video_tokens += grid[0] * grid[1] * grid[2] // spec.merge_size**2
        expanded = _expand_videos(text, spec.video_token, placeholders)
        mm["pixel_values_videos"] = torch.cat(patches)
        mm["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if not spec.media.frame_timestamps:  # Qwen3-VL puts timestamps in the text instead
            mm["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
    return expanded, mm, video_tokens, clips


def encode_multimodal_prompt(
    processor: Any,
    messages: list[dict[str, Any]],
    images: Sequence[MediaRef | Image.Image],
    videos: Sequence[MediaRef],
    data_cfg: Any,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    audios: Sequence[MediaRef] = (),
) -> dict[str, Any]:
    """Model inputs for one prompt with media.

    Args:
        processor: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL processor (see :func:`easyrl.models.load_processor`).
        messages: the conversation, string contents holding ``<image>`` / ``<video>`` placeholders (as produced by
            ``PromptRenderer.messages``), or part lists.
        images: the row's images (paths, bytes or PIL images), in placeholder order.
        videos: the row's videos (paths or bytes), in placeholder order.
        data_cfg: the ``data`` config (``min_pixels``, ``max_pixels``, ``video_fps``, ``max_frames``,
            ``limit_images``).
        chat_template, template_kwargs: the processor's chat template's override and extra variables.
        audios: the row's audio clips (paths or bytes), in placeholder order; Omni models only
            (:func:`easyrl.data.audio.encode_omni_prompt`: ``input_features`` and ``feature_attention_mask`` join
            ``multi_modal_inputs``, ``audio_tokens`` the counts).

    Returns:
        ``input_ids`` (list of ints, media pads expanded), ``prompt`` (the templated text before expansion),
        ``multi_modal_inputs`` (``pixel_values`` (N, D), ``image_grid_thw`` (n, 3); with videos also
        ``pixel_values_videos``, ``video_grid_thw`` and, except for Qwen3-VL, ``second_per_grid_ts``), and the
        counts ``image_tokens`` / ``video_tokens``; for an engine that processes pixels itself (vLLM), ``images``: the
        resized PIL images the patches were cut from, and ``videos``: ``(frames, metadata)`` per video, the sampled
        resized uint8 frames (T, H, W, 3) and :meth:`VideoClip.metadata`.

    Raises:
        MultimodalError: more images than ``limit_images``, placeholders not matching the media, a bad image size.
    """
    spec = vision_spec(processor)
    _check_limit(images, data_cfg)
    _check_audio(spec, videos, audios)
    messages = media_messages(messages, len(images), len(videos), len(audios))
    text = _render(processor, messages, chat_template, template_kwargs)
    if spec.media.takes_audio:  # the Omni thinkers: audio and images, their pads expanded by easyrl.data.audio
        from easyrl.data.audio import AudioError, encode_omni_prompt

        pil = [fit_image(load_image(ref), spec, data_cfg.min_pixels, data_cfg.max_pixels) for ref in images]
        try:
            encoded = encode_omni_prompt(processor, text, pil, audios, spec)
        except AudioError as exc:
            raise MultimodalError(str(exc)) from exc
        return {**encoded, "prompt": text, "video_tokens": 0, "images": pil, "videos": []}
    expanded, mm, video_tokens, clips = _encode_videos(text, videos, spec, data_cfg)
    pil_images = [fit_image(load_image(ref), spec, data_cfg.min_pixels, data_cfg.max_pixels) for ref in images]
    encoded = processor(
        text=[expanded],
        images=pil_images or None,
        do_resize=False,  # already resized to multiples of the merged patch within the pixel budget
        add_special_tokens=False,  # the chat template wrote them
        return_tensors="pt",
    )
    image_tokens = 0
    if pil_images:
        mm["pixel_values"] = encoded["pixel_values"]
        mm["image_grid_thw"] = encoded["image_grid_thw"].long()
        # t * h * w patches per image, merge_size**2 of them per token
        image_tokens = int(mm["image_grid_thw"].prod(dim=-1).sum()) // spec.merge_size**2
    return {
        "input_ids": encoded["input_ids"][0].tolist(),
        "prompt": text,
        "multi_modal_inputs": mm,
        "image_tokens": image_tokens,
        "video_tokens": video_tokens,
        "audio_tokens": 0,
        "images": pil_images,
        "videos": [(clip.frames, clip.metadata()) for clip in clips],
    }


@dataclass
class MediaTokenCounts:
    """Token counts of a prompt with its media expanded."""

    image_tokens: int
    video_tokens: int
    prompt_tokens: int
    """All tokens of the prompt: chat template, text and media pads (what the model sees)."""
    max_prompt_length: int
    images: int
    videos: int
    audio_tokens: int = 0
    audios: int = 0

    @property
    def overlong(self) -> bool:
        """The expanded prompt does not fit ``data.max_prompt_length`` (the row must be dropped)."""
        return self.prompt_tokens > self.max_prompt_length


def media_token_counts(
    processor: Any,
    messages: list[dict[str, Any]],
    images: Sequence[MediaRef | Image.Image],
    videos: Sequence[MediaRef],
    data_cfg: Any,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    audios: Sequence[MediaRef] = (),
) -> MediaTokenCounts:
    """The token counts :func:`encode_multimodal_prompt` would produce, from image sizes and video metadata only
    (no pixels are decoded, except to count a video's frames when the container does not say)."""
    spec = vision_spec(processor)
    _check_limit(images, data_cfg)
    _check_audio(spec, videos, audios)
    messages = media_messages(messages, len(images), len(videos), len(audios))
    text = _render(processor, messages, chat_template, template_kwargs)
    per_merge = spec.merge_size**2
    image_tokens = 0
    for ref in images:
        h, w = smart_resize(*_image_size(ref), spec.factor, data_cfg.min_pixels, data_cfg.max_pixels)
        image_tokens += (h // spec.patch_size) * (w // spec.patch_size) // per_merge
    video_tokens = 0
    placeholders = []
    for ref in videos:
        total, fps, height, width = _video_meta(ref)
        indices = sample_frame_indices(total, fps, data_cfg.video_fps, data_cfg.max_frames, spec.temporal_patch_size)
        lo, hi = _frame_budget(data_cfg.min_pixels, data_cfg.max_pixels, len(indices), spec)
        h, w = smart_resize(height, width, spec.factor, lo, hi)
        grid = [len(indices) // spec.temporal_patch_size, h // spec.patch_size, w // spec.patch_size]
        video_tokens += grid[0] * grid[1] * grid[2] // per_merge
        placeholders.append(_video_placeholder(spec, grid, _frame_times(indices, fps, spec.temporal_patch_size)))
    if videos:
        text = _expand_videos(text, spec.video_token, placeholders)
    audio_tokens = 0
    if audios:
        from easyrl.data.audio import AudioError, omni_token_counts

        try:
            audio_tokens, base = omni_token_counts(processor, text, audios, spec.family)
        except AudioError as exc:
            raise MultimodalError(str(exc)) from exc
    else:
        base = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    # Each image's (and clip's) single pad in the template becomes image-token-many (audio-token-many) pads.
    prompt_tokens = base + image_tokens - len(images) + audio_tokens - len(audios)
    return MediaTokenCounts(
        image_tokens,
        video_tokens,
        prompt_tokens,
        int(data_cfg.max_prompt_length),
        len(images),
        len(videos),
        audio_tokens,
        len(audios),
    )
