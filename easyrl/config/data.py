"""Configuration of the dataset, prompt formatting and batch sizes (``data.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    train_files: str = ""
    """Training data: a jsonl/json/parquet/csv file, a folder of them, a `datasets` folder saved with
    `save_to_disk`, optionally suffixed `@split` (e.g. `data/train.parquet`, `data/math@train`), or a hub dataset
    ID `org/name@split` (split `train` when omitted) fetched once by the driver into the Hugging Face cache.
    Comma-separated entries are concatenated."""
    val_files: str = ""
    """Validation data, same forms as `train_files`. Empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (passed to the template as `content`)."""
    answer_key: str = "answer"
    """Column holding the ground truth handed to the reward function as `ground_truth`."""
    image_key: str = "images"
    """Column holding images (paths relative to `image_dir`, bytes, or lists of them)."""
    video_key: str = "videos"
    """Column holding videos (paths relative to `video_dir`, or lists of them)."""
    image_dir: str | None = None
    """Folder that relative image paths are resolved against."""
    video_dir: str | None = None
    """Folder that relative video paths are resolved against."""
    audio_key: str = "audios"
    """Column holding audio clips (paths relative to `audio_dir`, bytes, or lists of them); Omni models only. Each clip
    is decoded with PyAV and resampled to the feature extractor's sampling rate (16 kHz for Qwen2.5-Omni)."""
    audio_dir: str | None = None
    """Folder that relative audio paths are resolved against (and confined to)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (chat template and media tokens included)."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    rollout_batch_size: int = 512
    """Prompts per training step (each sampled `worker.rollout.n` times)."""
    mini_rollout_batch_size: int | None = None
    """With online filtering: prompts sampled per try while refilling a batch (default: rollout_batch_size)."""
    val_batch_size: int = -1
    """Prompts per validation batch; -1: the whole validation set at once."""
    format_prompt: str | None = None
    """Path to a jinja template that turns a row into the user message. The prompt column is `content`; every
    column of the row is available too. None: the prompt column is used as is."""
    override_chat_template: str | None = None
    """A jinja chat template (inline text or a path to a .jinja file) replacing the tokenizer's own."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables every rendering of the chat template gets, e.g. `{enable_thinking: false}` for Qwen3's
    template: RL prompts and SFT conversations alike."""
    shuffle: bool = True
    """Shuffle the training data every epoch (seeded by `seed`)."""
    seed: int = 1
    """Seed of the data order."""
    min_pixels: int = 262144
    """Smallest image area in pixels after resizing (vision-language models)."""
    max_pixels: int = 4194304
    """Largest image area in pixels after resizing (vision-language models)."""
    video_fps: float = 2.0
    """Frames per second sampled from videos, evenly spaced, the first and the last frame always among them."""
    max_frames: int = 64
    """Most frames sampled per video (the frame budget; Long-RL's `worker.rollout.num_video_frames`, up to 8,192 for
    hour-long videos): a longer video is sampled evenly at fewer frames a second, still first to last frame."""
    limit_images: int = 0
    """Most images per prompt; 0: no limit."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` (with a reported count); false: it is an error."""
    on_bad_row: str = "drop"
    """What a malformed row (missing key, wrong type, unreadable media) does: `drop` (counted per reason)
    or `error` (stop, naming the file and row)."""
    cache_dir: str | None = None
    """Vision-language models: folder of the on-disk cache of video and image embeddings (the vision tower's
    outputs, one safetensors file per item; `easyrl cache-embeds CONFIG` fills it). Serves frozen towers only
    (`worker.actor.model.freeze_vision_tower`, the reference); null: no disk cache. Long-RL's
    `worker.actor.cached_embeds_dir` is accepted as this key."""
    cache_max_gb: float = 50.0
    """Size limit of `cache_dir` in GiB; the least recently used entries are evicted past it."""
