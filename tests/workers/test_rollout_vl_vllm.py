"""Vision-language rollout through vLLM.

On CPU (vLLM's CPU build cannot load the Qwen-VL model files here: they import torchvision, see
docs/vllm_cpu_notes.md) we check what we hand to vLLM: the prompt with one slot per image / video, the very pixels
and frames the actor's patches were cut from, and that expanding the slots from them gives the actor's prompt. On the
GPU machine 2-step GRPO runs (images, videos) go through the real engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from easyrl.config.data import DataConfig
from easyrl.data import RLDataset, collate_prompts
from easyrl.data.multimodal import patchify_frames
from easyrl.models import load_processor
from easyrl.models.processor import vision_spec
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from tests.data.test_multimodal import _write_video


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def _rows(folder: Path) -> list[dict[str, Any]]:
    for i, size in enumerate([(40, 24), (64, 64), (24, 56)]):
        Image.new("RGB", size, (40 * i, 200 - 50 * i, 90)).save(folder / f"im{i}.png")
    return [
        {"prompt": "<image> and <image>: same colour?", "answer": "no", "images": ["im0.png", "im1.png"]},
        {"prompt": "What is 2+2?", "answer": "4"},
        {"prompt": "Describe <image>", "answer": "x", "images": ["im2.png"]},
    ]


def _dataset(folder: Path, model: str, rows: list[dict[str, Any]], **overrides: Any) -> RLDataset:
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dataclasses.replace(
        DataConfig(max_prompt_length=512, image_dir=str(folder), video_dir=str(folder)), **overrides
    )
    processor = load_processor(model)
    return RLDataset(str(data), cfg, processor.tokenizer, processor, rollout_media=True)


def _expand_like_vllm(request: dict[str, Any], processed: dict[str, torch.Tensor], processor: Any) -> list[int]:
    """The prompt vLLM's processor builds from a request: every image / video slot replaced, from the grids and the
    video metadata alone, by the tokens the model expects (one pad per merged patch; Qwen3-VL: per temporal patch
    "<t seconds>" and the frame's pads between vision start/end, t the mean time of its frames)."""
    spec = vision_spec(processor)
    tok = processor.tokenizer
    image_pad, video_pad = (tok.convert_tokens_to_ids(t) for t in (spec.image_token, spec.video_token))
    merge = spec.merge_size**2
    images = iter(processed.get("image_grid_thw", torch.zeros(0, 3)).tolist())
    videos = iter(
        zip(processed.get("video_grid_thw", torch.zeros(0, 3)).tolist(), request["multi_modal_data"].get("video", []))
    )
    out: list[int] = []
    for token in request["prompt_token_ids"]:
        if token == image_pad:
            t, h, w = next(images)
            out += [image_pad] * (t * h * w // merge)
        elif token == video_pad:
            (t, h, w), (_, meta) = next(videos)
            if spec.family != "qwen3_vl":
                out += [video_pad] * (t * h * w // merge)
                continue
            times = [i / meta["fps"] for i in meta["frames_indices"]]
            tp = spec.temporal_patch_size
            for k in range(t):
                stamp = (times[k * tp] + times[k * tp + tp - 1]) / 2
                out += tok(f"<{stamp:.1f} seconds>", add_special_tokens=False)["input_ids"]
                out += [tok.convert_tokens_to_ids(spec.vision_start), *[video_pad] * (h * w // merge)]
                out.append(tok.convert_tokens_to_ids(spec.vision_end))
        else:
            out.append(token)
    return out


def _slot_ids(processor: Any) -> dict[str, int | None]:
    spec = vision_spec(processor)
    return {
        "image": processor.tokenizer.convert_tokens_to_ids(spec.image_token),
        "video": processor.tokenizer.convert_tokens_to_ids(spec.video_token),
    }


@needs_vllm
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vllm_requests_carry_the_actors_pixels(tmp_path: Path, arch: str) -> None:
    from easyrl.rollout.vllm import vllm_request

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch, min_pixels=16 * 16, max_pixels=64 * 64)
    ds = _dataset(tmp_path, model, _rows(tmp_path), min_pixels=16 * 16, max_pixels=48 * 48)
    processor = ds.processor
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ds.media_per_row() == {"image": 2, "video": 0}
    batch = collate_prompts([ds[i] for i in range(len(ds))], processor.tokenizer.pad_token_id, 512)
    assert [len(m.get("multi_modal_data", {}).get("image", [])) for m in batch["rollout_prompt"]] == [2, 0, 1]
    # `easyrl check`'s prompt lengths are the expanded ones the model sees (and the overlong filter measures)
    assert ds.prompt_length_stats()["max"] == batch["attention_mask"].sum(dim=1).max().item()
    for i, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        prompt = ids[mask.bool()].tolist()
        media, processed = batch["rollout_prompt"][i], batch["multi_modal_inputs"][i]
        request = vllm_request(prompt, media, _slot_ids(processor))
        if not media:
            assert request == {"prompt_token_ids": prompt}
            continue
        images = request["multi_modal_data"]["image"]
        assert request["prompt_token_ids"].count(pad) == len(images)
        assert prompt.count(pad) > len(images)  # the actor's prompt is expanded, one pad per merged patch
        assert _expand_like_vllm(request, processed, processor) == prompt
        # The images vLLM's processor receives, not resized again, give exactly the actor's patches and grids.
        assert request["mm_processor_kwargs"] == {"do_resize": False}
        again = processor.image_processor(images=images, do_resize=False, return_tensors="pt")
        assert torch.equal(again["image_grid_thw"], processed["image_grid_thw"])
        assert torch.equal(again["pixel_values"], processed["pixel_values"])


@needs_vllm
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vllm_video_requests_carry_the_actors_frames(tmp_path: Path, arch: str) -> None:
    """A row with a video and an image: the request holds the sampled frames the actor's patches were cut from, and
    metadata from which the model's processor derives the actor's seconds per patch (Qwen2.5-VL) or the frame
    timestamps in the prompt (Qwen3-VL)."""
    from transformers.video_utils import VideoMetadata

    from easyrl.rollout.vllm import vllm_request

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch)
    _write_video(tmp_path / "clip.mp4")  # 12 frames at 4 fps: 3 s
    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "red.png")
    rows = [
        {
            "prompt": "<video> then <image>: what moves?",
            "answer": "bar",
            "videos": ["clip.mp4"],
            "images": ["red.png"],
        },
        {"prompt": "What is 2+2?", "answer": "4"},
    ]
    ds = _dataset(tmp_path, model, rows, min_pixels=16 * 16, max_pixels=48 * 48, video_fps=2.0, max_frames=8)
    processor = ds.processor
    spec = vision_spec(processor)
    assert ds.media_per_row() == {"image": 1, "video": 1}
    item = ds[0]
    request = vllm_request(item["prompt_ids"], item["rollout_prompt"], _slot_ids(processor))
    processed = item["multi_modal_inputs"]
    ((frames, meta),) = request["multi_modal_data"]["video"]
    assert meta["do_sample_frames"] is False and frames.dtype == np.uint8
    patches, grid = patchify_frames(frames, spec)
    assert torch.equal(patches, processed["pixel_values_videos"])
    assert grid == processed["video_grid_thw"][0].tolist() and grid[0] == 3  # 6 frames at 2 fps
    metadata = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
    assert len(metadata.frames_indices) == len(frames) and metadata.total_num_frames == 12
    if spec.family != "qwen3_vl":
        seconds = spec.temporal_patch_size / metadata.sampled_fps
        assert torch.allclose(processed["second_per_grid_ts"], torch.tensor([seconds]))
    assert _expand_like_vllm(request, processed, processor) == item["prompt_ids"]
    assert ds[1]["rollout_prompt"] == {}


@needs_vllm
def test_vllm_request_refuses_mismatched_slots() -> None:
    from easyrl.rollout.vllm import vllm_request

    image = np.zeros((16, 16, 3), np.uint8)
    two_images = {"prompt_token_ids": [1, 9, 2], "multi_modal_data": {"image": [image, image]}}
    with pytest.raises(ValueError, match="1 image slots for 2 images"):
        vllm_request([1, 9, 9, 2], two_images, {"image": 9, "video": 8})
    with pytest.raises(ValueError, match="no image_token_id"):
        vllm_request([1, 9, 2], two_images, {"image": None})
    video = {"prompt_token_ids": [1, 2], "multi_modal_data": {"video": [(np.zeros((2, 16, 16, 3), np.uint8), {})]}}
    with pytest.raises(ValueError, match="0 video slots for 1 videos"):
        vllm_request([1, 8, 8, 2], video, {"image": 9, "video": 8})


@needs_vllm
def test_expansion_check_compares_token_for_token() -> None:
    """vLLM's expanded prompt must be the actor's token for token; a same-length prompt with another token (e.g. a
    different frame timestamp) is refused, naming where they part."""
    from types import SimpleNamespace

    from easyrl.rollout.vllm import _check_media_expansion

    request = {"prompt_token_ids": [1, 9, 2], "multi_modal_data": {"image": []}}
    actor = [1, 9, 9, 9, 2]
    _check_media_expansion(SimpleNamespace(prompt_token_ids=actor), request, actor, 0)
    _check_media_expansion(SimpleNamespace(prompt_token_ids=[1, 9, 2]), request, actor, 0)  # reported unexpanded
    with pytest.raises(RuntimeError, match=r"sequence 3 .* first differ at token 2 \(vLLM \[7, 9, 2\]"):
        _check_media_expansion(SimpleNamespace(prompt_token_ids=[1, 9, 7, 9, 2]), request, actor, 3)


def _video_data(folder: Path) -> dict[str, str]:
    """8 rows, each with a generated 3 s video (4 fps) of its own size."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(8):
        _write_video(folder / f"clip{i}.mp4", size=(48 + 16 * (i % 3), 32 + 16 * (i % 2)))
        rows.append({"prompt": f"<video>How many digits are in {i}{i}?", "answer": "2", "videos": [f"clip{i}.mp4"]})
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": str(train), "video_dir": str(folder)}


@pytest.mark.gpu
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("media", ["image", "video"])
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_grpo_through_vllm(tmp_path: Path, arch: str, media: str) -> None:
    """2 GRPO steps of a tiny VL model with the real vLLM engine: images or videos go through vLLM's processor (which
    must expand them to the actor's very prompt, or generation stops), the new weights (vision tower included) are
    synced each step, and the engine's log-probs match the actor's."""
    from easyrl.distributed import init_ray
    from tests.trainer.test_e2e import assert_finite, run
    from tests.trainer.test_vl_e2e import _image_data, vl_edits

    init_ray(num_cpus=4)
    # Head size 32 in the language model and the vision tower (attention kernels reject 16).
    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch, num_heads=2, num_kv_heads=1, vision_hidden_size=64)
    if media == "image":
        data = _image_data(tmp_path / "data")
        edits = vl_edits(data)
    else:
        data = _video_data(tmp_path / "data")
        edits = {
            "data.video_dir": data["video_dir"],
            "data.max_prompt_length": 256,
            "data.min_pixels": 16 * 16,
            "data.max_pixels": 64 * 64,
            "data.video_fps": 2.0,
        }
    edits |= {
        "worker.rollout.name": "vllm",
        "worker.rollout.dtype": "bf16",
        "worker.rollout.gpu_memory_utilization": 0.2,
        "trainer.device": "cuda",
        "trainer.n_gpus_per_node": 1,
    }
    rows, before, after = run(tmp_path / "run", model, {"train": data["train"]}, edits, steps=2, weights=True)
    assert_finite(rows)
    assert "timing_s/update_weights" in rows[1]
    for row in rows:
        # bf16 engine vs fp32 actor; banning the 4 vision tokens (logit bias) also renormalizes vLLM's processed
        # log-probs slightly.
        assert row["rollout/logprob_diff_mean"] < 0.05, row["rollout/logprob_diff_mean"]
    assert before is not None and after is not None
    assert any(not torch.equal(before[n], after[n]) for n in before)
