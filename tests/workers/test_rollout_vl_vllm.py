"""Vision-language rollout through vLLM.

On CPU (vLLM's CPU build cannot load the Qwen-VL model files here: they import torchvision, see
docs/vllm_cpu_notes.md) we check what we hand to vLLM: the prompt with one slot per image and the very pixels the
actor's patches were cut from. On the GPU machine a 2-step GRPO run goes through the real engine.
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
from easyrl.data import DataError, RLDataset, collate_prompts
from easyrl.models import load_processor
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
        DataConfig(max_prompt_length=256, image_dir=str(folder), video_dir=str(folder)), **overrides
    )
    processor = load_processor(model)
    return RLDataset(str(data), cfg, processor.tokenizer, processor, rollout_images=True)


@needs_vllm
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vllm_requests_carry_the_actors_pixels(tmp_path: Path, arch: str) -> None:
    from easyrl.workers.rollout.vllm import collapse_media_pads, vllm_request

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch, min_pixels=16 * 16, max_pixels=64 * 64)
    ds = _dataset(tmp_path, model, _rows(tmp_path), min_pixels=16 * 16, max_pixels=48 * 48)
    processor = ds.processor
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = collate_prompts([ds[i] for i in range(len(ds))], processor.tokenizer.pad_token_id, 256)
    assert [len(m.get("image", [])) for m in batch["multi_modal_data"]] == [2, 0, 1]
    for i, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        prompt = ids[mask.bool()].tolist()
        media, processed = batch["multi_modal_data"][i], batch["multi_modal_inputs"][i]
        request = vllm_request(prompt, media, pad)
        if not media:
            assert request == {"prompt_token_ids": prompt}
            continue
        images = request["multi_modal_data"]["image"]
        assert request["prompt_token_ids"] == collapse_media_pads(prompt, pad)
        assert request["prompt_token_ids"].count(pad) == len(images)
        assert prompt.count(pad) > len(images)  # the actor's prompt is expanded, one pad per merged patch
        # The images vLLM's processor receives give exactly the actor's patches and grids.
        again = processor.image_processor(images=images, do_resize=False, return_tensors="pt")
        assert torch.equal(again["image_grid_thw"], processed["image_grid_thw"])
        assert torch.equal(again["pixel_values"], processed["pixel_values"])
        merge = processor.image_processor.merge_size**2
        assert int(processed["image_grid_thw"].prod(dim=-1).sum()) // merge == prompt.count(pad)


@needs_vllm
def test_vllm_request_refuses_mismatched_slots() -> None:
    from easyrl.workers.rollout.vllm import collapse_media_pads, vllm_request

    assert collapse_media_pads([1, 9, 9, 9, 2, 9, 9, 3, 9], 9) == [1, 9, 2, 9, 3, 9]
    image = np.zeros((16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="1 image slots for 2 images"):
        vllm_request([1, 9, 9, 2], {"image": [image, image]}, 9)
    with pytest.raises(ValueError, match="no image_token_id"):
        vllm_request([1, 9, 2], {"image": [image]}, None)


def test_video_rows_are_refused_for_vllm_before_training(tmp_path: Path) -> None:
    model = build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl")
    _write_video(tmp_path / "clip.mp4")
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "<video> moves?", "answer": "yes", "videos": ["clip.mp4"]}]
    with pytest.raises(DataError, match=r"train.jsonl, row 1: videos are not supported by the vLLM rollout"):
        _dataset(tmp_path, model, rows)


@pytest.mark.gpu
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_grpo_through_vllm(tmp_path: Path, arch: str) -> None:
    """2 GRPO steps of a tiny VL model with the real vLLM engine: images go through vLLM's processor, the new
    weights (vision tower included) are synced each step, and the engine's log-probs match the actor's."""
    from easyrl.distributed import init_ray
    from tests.trainer.test_e2e import assert_finite, run
    from tests.trainer.test_vl_e2e import _image_data, vl_edits

    init_ray(num_cpus=4)
    # Head size 32 in the language model and the vision tower (attention kernels reject 16).
    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch, num_heads=2, num_kv_heads=1, vision_hidden_size=64)
    data = _image_data(tmp_path / "data")
    edits = vl_edits(data) | {
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
