"""The media pipeline: resizing, placeholders, processor round trip, token counts, overlong rows, videos."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from easyrl.data.multimodal import (
    MultimodalError,
    encode_multimodal_prompt,
    media_messages,
    media_token_counts,
    patchify_frames,
    sample_frame_indices,
    smart_resize,
)
from easyrl.models import vision_spec
from easyrl.testing.tiny_vl import VL_ARCHS, make_vl_processor, make_vl_tokenizer


def _cfg(**overrides: Any) -> SimpleNamespace:
    base = {"min_pixels": 16 * 16, "max_pixels": 64 * 64, "video_fps": 2.0, "max_frames": 8, "limit_images": 0}
    return SimpleNamespace(**{**base, "max_prompt_length": 512, **overrides})


@pytest.fixture(scope="module", params=VL_ARCHS)
def processor(request: pytest.FixtureRequest) -> Any:
    return make_vl_processor(make_vl_tokenizer(), request.param)


def _png(size: tuple[int, int], colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    ("height", "width", "lo", "hi"),
    [(48, 64, 256, 4096), (1000, 700, 256, 4096), (5, 9, 1024, 4096), (30, 300, 0, 10**6)],
)
def test_smart_resize_respects_bounds_and_factor(height: int, width: int, lo: int, hi: int) -> None:
    h, w = smart_resize(height, width, 16, lo, hi)
    assert h % 16 == 0 and w % 16 == 0
    assert lo <= h * w <= hi
    assert abs(h / w - height / width) < 0.5 * height / width + 0.5  # aspect kept up to rounding


def test_smart_resize_rejects_extreme_aspect() -> None:
    with pytest.raises(MultimodalError):
        smart_resize(1, 500, 16, 256, 4096)


def test_placeholders_become_parts() -> None:
    msgs = media_messages(_user("a <image> b <video> c <image>"), 2, 1)
    kinds = [p["type"] for p in msgs[0]["content"]]
    assert kinds == ["text", "image", "text", "video", "text", "image"]
    assert media_messages(_user("no placeholder"), 1, 0)[0]["content"][0] == {"type": "image"}
    assert media_messages(_user("text only"), 0, 0)[0]["content"] == [{"type": "text", "text": "text only"}]
    with pytest.raises(MultimodalError, match="placeholders"):
        media_messages(_user("<image> <image>"), 1, 0)


def test_processor_round_trip(processor: Any, tmp_path: Path) -> None:
    spec = vision_spec(processor)
    path = tmp_path / "img.png"
    path.write_bytes(_png((64, 48)))
    enc = encode_multimodal_prompt(
        processor, _user("Find x. <image> Then <image>."), [str(path), _png((20, 90))], [], _cfg()
    )
    ids = enc["input_ids"]
    mm = enc["multi_modal_inputs"]
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    grids = mm["image_grid_thw"].tolist()
    assert grids[0] == [1, 6, 8]  # 64x48 already fits: 8x6 patches of 8 pixels
    assert ids.count(image_id) == enc["image_tokens"] == sum(t * h * w for t, h, w in grids) // 4
    assert mm["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8)
    text = processor.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nFind x. <|vision_start|><|image_pad|>")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert enc["prompt"].count("<|image_pad|>") == 2


def test_token_counts_match_encoding_and_flag_overlong(processor: Any) -> None:
    images = [_png((64, 48)), _png((200, 120))]
    msgs = _user("Angle <image> and <image>?")
    enc = encode_multimodal_prompt(processor, msgs, images, [], _cfg())
    counts = media_token_counts(processor, msgs, images, [], _cfg())
    assert counts.image_tokens == enc["image_tokens"] > 0
    assert counts.prompt_tokens == len(enc["input_ids"])
    assert not counts.overlong
    # The text alone fits, the media tokens do not: the classic "image features and image tokens" failure.
    text_only = len(processor.tokenizer(enc["prompt"], add_special_tokens=False)["input_ids"])
    tight = media_token_counts(processor, msgs, images, [], _cfg(max_prompt_length=text_only + 5))
    assert tight.overlong and tight.prompt_tokens > text_only + 5


def test_limit_images(processor: Any) -> None:
    with pytest.raises(MultimodalError, match="limit_images"):
        media_token_counts(processor, _user("<image><image>"), [_png((32, 32))] * 2, [], _cfg(limit_images=1))


def test_frame_sampling() -> None:
    assert sample_frame_indices(100, 25.0, 2.0, 64) == [int(x) for x in np.rint(np.linspace(0, 99, 8))]  # 4 s * 2
    assert len(sample_frame_indices(1000, 10.0, 2.0, 7)) == 6  # max_frames, rounded down to the patch
    assert sample_frame_indices(1, 30.0, 2.0, 64) == [0, 0]  # one frame: repeated to a temporal patch
    assert len(sample_frame_indices(10, 30.0, 2.0, 64)) == 2


def test_video_patches_match_the_image_layout(processor: Any) -> None:
    """Two identical frames give exactly the image processor's patches (it repeats a still image in time)."""
    spec = vision_spec(processor)
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    patches, grid = patchify_frames(np.stack([frame, frame]), spec)
    ref = processor.image_processor(images=[Image.fromarray(frame)], do_resize=False, return_tensors="pt")
    assert grid == ref["image_grid_thw"][0].tolist()
    assert torch.allclose(patches, ref["pixel_values"].float(), atol=1e-5)


def _write_video(path: Path, frames: int = 12, fps: int = 4, size: tuple[int, int] = (80, 48)) -> None:
    av = pytest.importorskip("av")
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            arr = np.zeros((height, width, 3), np.uint8)
            arr[:, : (i + 1) * width // frames] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_encoding(processor: Any, tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    _write_video(path)  # 3 s at 4 fps -> 6 frames at 2 fps -> 3 temporal patches
    spec = vision_spec(processor)
    msgs = _user("What moves? <video> And here <image>")
    images = [_png((32, 32))]
    enc = encode_multimodal_prompt(processor, msgs, images, [str(path)], _cfg())
    mm = enc["multi_modal_inputs"]
    grid = mm["video_grid_thw"].tolist()[0]
    assert grid[0] == 3
    video_id = processor.tokenizer.convert_tokens_to_ids(spec.video_token)
    assert enc["input_ids"].count(video_id) == enc["video_tokens"] == grid[0] * grid[1] * grid[2] // 4
    assert mm["pixel_values_videos"].shape[0] == grid[0] * grid[1] * grid[2]
    assert ("second_per_grid_ts" in mm) == (spec.family != "qwen3_vl")
    if spec.family == "qwen3_vl":
        assert "<0.2 seconds>" in processor.tokenizer.decode(enc["input_ids"])  # mean of frames 0 and 2 at 4 fps
    else:
        assert torch.allclose(mm["second_per_grid_ts"], torch.tensor([1.0]))  # 2 frames per patch at 2 fps
    counts = media_token_counts(processor, msgs, images, [path.read_bytes()], _cfg())
    assert (counts.video_tokens, counts.prompt_tokens) == (enc["video_tokens"], len(enc["input_ids"]))
