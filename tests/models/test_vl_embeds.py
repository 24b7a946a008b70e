"""One tower encoding per video: deduplicated within a forward, reused across passes (frozen towers), split by frames;
counted with a forward hook on the real tiny tower, and log-probs compared with the plain path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from easyrl.batch import Batch
from easyrl.data.multimodal import encode_multimodal_prompt
from easyrl.models import freeze_vision_tower, load_processor, vision_tower
from easyrl.models.embed_cache import EmbedCache, tower_version
from easyrl.models.vl_embeds import _MEMO, EmbedReuse, install_embed_reuse
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from easyrl.workers.forward_backward import batched_log_probs


DATA_CFG = SimpleNamespace(min_pixels=16 * 16, max_pixels=48 * 48, video_fps=4.0, max_frames=16, limit_images=0)
RESPONSE = 4
N = 3  # samples per prompt


def write_video(path: Path, seed: int, frames: int = 8, fps: int = 4, size: tuple[int, int] = (48, 32)) -> str:
    """A short random-noise clip (every frame different, so the frames matter)."""
    av = pytest.importorskip("av")
    rng = np.random.default_rng(seed)
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def video_batch(processor: Any, videos: list[str], n: int = N) -> Batch:
    """One prompt per video, each repeated `n` times (as a rollout's n samples), left-padded, 4 response tokens."""
    encoded = [
        encode_multimodal_prompt(processor, [{"role": "user", "content": "What? <video>"}], [], [v], DATA_CFG)
        for v in videos
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    pad = processor.tokenizer.pad_token_id
    rows = len(encoded) * n
    ids = torch.full((rows, width + RESPONSE), pad)
    mask = torch.zeros_like(ids)
    media = []
    responses = torch.tensor([[ord(c) for c in "abcd"]]).repeat(rows, 1) + torch.arange(rows)[:, None] % n
    for row in range(rows):
        e = encoded[row // n]
        length = len(e["input_ids"])
        ids[row, width - length : width] = torch.tensor(e["input_ids"])
        mask[row, width - length :] = 1
        media.append(e["multi_modal_inputs"])
    ids[:, width:] = responses
    return Batch({"input_ids": ids, "attention_mask": mask, "responses": responses}, {"multi_modal_inputs": media})


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, list[str]]:
    root = tmp_path_factory.mktemp("vl")
    path = build_tiny_vl_checkpoint(root / request.param, request.param)
    videos = [write_video(root / f"v{i}.mp4", seed=i) for i in range(2)]
    return load_processor(path), path, videos


def count_tower_calls(model: Any) -> list[int]:
    calls = [0]
    vision_tower(model).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _log_probs(model: Any, batch: Batch, micro: int) -> torch.Tensor:
    return batched_log_probs(model, batch, torch.device("cpu"), 1.0, micro)[0]


def test_frames_encode_independently(vl: tuple[Any, str, list[str]]) -> None:
    """The premise of the split: a video's tower output equals its frames' outputs encoded one by one."""
    processor, path, videos = vl
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    mm = video_batch(processor, videos[:1], n=1)["multi_modal_inputs"][0]
    tower: Any = vision_tower(model)
    pixels, grid = mm["pixel_values_videos"], mm["video_grid_thw"]
    t, h, w = (int(x) for x in grid[0])
    assert t >= 2
    with torch.no_grad():
        whole = tower(pixels, grid_thw=grid).pooler_output
        frames = tower(pixels, grid_thw=torch.tensor([[1, h, w]] * t)).pooler_output
    torch.testing.assert_close(frames, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("frozen", [True, False])
def test_one_encoding_per_video_same_log_probs(vl: tuple[Any, str, list[str]], frozen: bool) -> None:
    processor, path, videos = vl
    batch = video_batch(processor, videos)
    plain = AutoModelForImageTextToText.from_pretrained(path).eval()
    plain_calls = count_tower_calls(plain)
    expected = _log_probs(plain, batch, micro=2)
    assert plain_calls[0] == 3  # 6 rows in micro-batches of 2: one tower call each, 6 videos encoded

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    if frozen:
        freeze_vision_tower(model)
    _MEMO.items.clear()
    _MEMO.bytes = 0
    reuse = install_embed_reuse(model, tower_version(vision_tower(model)) if frozen else None)
    assert isinstance(reuse, EmbedReuse)
    calls = count_tower_calls(model)
    got = _log_probs(model, batch, micro=2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # micro-batches (v0 v0) (v0 v1) (v1 v1): the duplicates within each are encoded once
    assert reuse.encoded == (2 if frozen else 4)
    # a second pass (the reference's, the update's) reuses every frozen encoding: no tower call
    before = calls[0]
    again = _log_probs(model, batch, micro=3)
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)
    assert calls[0] - before == (0 if frozen else 2)


def test_disk_cache_serves_a_fresh_process(vl: tuple[Any, str, list[str]], tmp_path: Path) -> None:
    """A new model object (a new run) with the same frozen tower reads the encodings from disk: no tower call."""
    processor, path, videos = vl
    batch = video_batch(processor, videos, n=1)
    settings = {"video_fps": DATA_CFG.video_fps, "max_frames": DATA_CFG.max_frames}
    outs = []
    for run in range(2):
        _MEMO.items.clear()
        _MEMO.bytes = 0
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        freeze_vision_tower(model)
        cache = EmbedCache(tmp_path / "cache", max_gb=1.0)
        reuse = install_embed_reuse(model, tower_version(vision_tower(model)), cache, settings)
        assert reuse is not None
        calls = count_tower_calls(model)
        outs.append(_log_probs(model, batch, micro=2))
        assert (calls[0], cache.hits, cache.misses) == ((1, 0, 2) if run == 0 else (0, 2, 0))
    torch.testing.assert_close(outs[1], outs[0])
