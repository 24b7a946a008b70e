"""Thousands of frames: sampling at `data.video_fps` under the `data.max_frames` budget keeps the first and the last
frame, and decoding streams (a 1,200-frame video is read holding the sampled frames, not the video)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from easyrl.data.multimodal import load_video, sample_frame_indices
from easyrl.models import vision_spec
from easyrl.testing.long_video import COLOURS, colour_segments, write_colour_video
from easyrl.testing.tiny_vl import make_vl_processor, make_vl_tokenizer


def test_an_hour_at_2_fps_is_capped_to_the_budget_evenly_first_to_last() -> None:
    """7,200 frames wanted (an hour at 2 fps of a 30 fps video: 108,000 frames) over a 3,600-frame budget: 3,600
    frames, evenly spaced, the first and the last frame of the video among them (so the last temporal patch covers the
    video's final 1/1,800th, not a time range before it)."""
    indices = sample_frame_indices(108_000, 30.0, 2.0, 3600)
    assert len(indices) == 3600 and indices[0] == 0 and indices[-1] == 107_999
    gaps = np.diff(indices)
    assert gaps.min() >= 29 and gaps.max() <= 31  # 107,999 / 3,599 = 30.008 frames apart
    # under the budget, fps rules: 10 minutes at 2 fps is 1,200 frames, the last frame kept
    short = sample_frame_indices(18_000, 30.0, 2.0, 3600)
    assert len(short) == 1200 and short[-1] == 17_999
    assert len(sample_frame_indices(108_000, 30.0, 2.0, 8192)) == 7200  # Long-RL's largest budget: fps binds


def test_decoding_a_long_video_streams(tmp_path: Path) -> None:
    """1,200 frames of 160x160 (92 MB as RGB arrays) are decoded one at a time; the 16 sampled frames are resized as
    they are read: the peak of what Python allocates stays under a megabyte, and the last frame's colour is the clip's
    last frame."""
    import random

    path = tmp_path / "long.mp4"
    segments = colour_segments(random.Random(3), 1200, 100)
    write_colour_video(path, segments, fps=25, size=160)
    processor = make_vl_processor(make_vl_tokenizer(), "qwen2_5_vl")
    spec = vision_spec(processor)
    cfg = SimpleNamespace(min_pixels=16 * 16, max_pixels=8 * 32 * 32, video_fps=2.0, max_frames=16)
    tracemalloc.start()
    try:
        clip = load_video(str(path), spec, cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert clip.total_frames == 1200 and len(clip.indices) == 16 and clip.indices[-1] == 1199
    whole = 1200 * 160 * 160 * 3
    assert peak < 1_000_000 < whole // 90, f"peak {peak} bytes while decoding"
    last = clip.frames[-1].reshape(-1, 3).mean(0)
    assert np.abs(last - np.asarray(COLOURS[segments[-1][0]])).max() < 12  # mpeg4 and yuv420p round the colour


def test_the_last_colour_is_near_the_end_and_every_colour_comes_before() -> None:
    import random

    for seed in range(20):
        segments = colour_segments(random.Random(seed), 1000, 150)
        assert sum(n for _, n in segments) == 1000 and segments[-1][1] == 150
        assert segments[-1][0] != segments[-2][0]
        assert {c for c, _ in segments[:-1]} == set(COLOURS)  # the answer is among the distractors too
    with pytest.raises(ValueError, match="at least twice the tail"):
        from easyrl.testing.long_video import build_last_colour_task

        build_last_colour_task("unused", frames=100, tail=60)
