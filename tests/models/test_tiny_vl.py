"""The tiny Qwen2.5-VL / Qwen3-VL builders: the folder loads back and the model runs with images."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from easyrl.models import generate_with_media, load_processor, model_class_for, vision_spec
from easyrl.testing.tiny_vl import VISION_TOKENS, VL_ARCHS, build_tiny_vl_checkpoint


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / request.param, request.param)


def _inputs(processor: object) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    image = Image.new("RGB", (64, 48), (220, 30, 30))
    return processor(text=[text], images=[image], return_tensors="pt")  # type: ignore[operator]


def test_folder_contents_and_token_ids(vl_dir: str) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert os.path.isfile(os.path.join(vl_dir, name)), name
    with open(Path(vl_dir) / "config.json") as f:
        config = json.load(f)
    processor = load_processor(vl_dir)
    ids = processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    assert config["vision_start_token_id"] == ids[0]
    assert config["image_token_id"] == ids[2] and config["video_token_id"] == ids[3]
    spec = vision_spec(processor)
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (8, 2, 2)


def test_forward_with_image(vl_dir: str) -> None:
    processor = load_processor(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    inputs = _inputs(processor)
    # 64x48 pixels -> 8x6 patches -> 12 merged tokens.
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 12
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    out = model(**inputs)
    assert out.logits.shape[:2] == inputs["input_ids"].shape
    assert torch.isfinite(out.logits).all()


def test_generate_with_image(vl_dir: str) -> None:
    processor = load_processor(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    assert model_class_for(model.config) is AutoModelForImageTextToText
    inputs = _inputs(processor)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)
    media = [{"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}]
    ours = generate_with_media(
        model, inputs["input_ids"], inputs["attention_mask"], media, max_new_tokens=4, do_sample=False
    )
    assert torch.equal(ours, out)
    assert model.model.rope_deltas is None
