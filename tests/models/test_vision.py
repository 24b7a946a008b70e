"""3D positions, media in micro-batches, frozen vision towers and generation with media, on tiny VL models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from easyrl.batch import Batch
from easyrl.data.multimodal import encode_multimodal_prompt
from easyrl.models import (
    freeze_vision_tower,
    generate_with_media,
    load_processor,
    mrope_position_ids,
    multimodal_forward_kwargs,
    stack_media,
    vision_tower,
)
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint


DATA_CFG = SimpleNamespace(min_pixels=16 * 16, max_pixels=64 * 64, video_fps=2.0, max_frames=8, limit_images=0)
RESPONSE = 5


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / request.param, request.param)
    return load_processor(path), AutoModelForImageTextToText.from_pretrained(path)


def _batch(processor: Any) -> Batch:
    """Two left-padded prompts with one image each (different sizes) and 5 response tokens."""
    prompts = [
        ("Shape? <image>", (64, 48), (255, 0, 0)),
        ("Which colour is this one <image> here?", (32, 32), (0, 0, 255)),
    ]
    encoded = [
        encode_multimodal_prompt(
            processor, [{"role": "user", "content": text}], [Image.new("RGB", size, colour)], [], DATA_CFG
        )
        for text, size, colour in prompts
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    pad = processor.tokenizer.pad_token_id
    ids = torch.full((2, width + RESPONSE), pad)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[row, width - n : width] = torch.tensor(e["input_ids"])
        mask[row, width - n :] = 1
    responses = torch.tensor([[ord(c) for c in "abcde"], [ord(c) for c in "12345"]])
    ids[:, width:] = responses
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "responses": responses},
        {"multi_modal_inputs": [e["multi_modal_inputs"] for e in encoded]},
    )


def test_mrope_positions_shape_and_response_continuation(vl: tuple[Any, Any]) -> None:
    processor, model = vl
    batch = _batch(processor)
    media = stack_media(batch["multi_modal_inputs"])
    pos = mrope_position_ids(model, batch["input_ids"], batch["attention_mask"], media["image_grid_thw"])
    b, length = batch["input_ids"].shape
    assert pos.shape == (3, b, length)
    for row in range(b):
        valid = batch["attention_mask"][row].bool()
        assert (pos[:, row, ~valid] == 0).all()  # padding
        tail = pos[:, row, -RESPONSE - 1 :]  # last prompt token, then the response
        start = int(tail[0, 0])
        expected = torch.arange(start, start + RESPONSE + 1)
        assert torch.equal(tail, expected.expand(3, -1))  # text: the three components agree and count up
        # Vision tokens sit at smaller positions than the text after them: positions are not just 0..L-1.
        assert int(pos[0, row].max()) < int(valid.sum())
    from_config = mrope_position_ids(
        model.config, batch["input_ids"], batch["attention_mask"], media["image_grid_thw"]
    )
    assert torch.equal(from_config, pos)
    text_only = mrope_position_ids(model, batch["input_ids"], batch["attention_mask"])
    assert torch.equal(text_only[0], (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))


def test_micro_batches_select_their_own_patches(vl: tuple[Any, Any]) -> None:
    processor, model = vl
    batch = _batch(processor)
    whole = multimodal_forward_kwargs(batch, model)
    parts = [multimodal_forward_kwargs(mb, model) for mb in batch.split(1)]
    assert torch.equal(torch.cat([p["pixel_values"] for p in parts]), whole["pixel_values"])
    assert [p["image_grid_thw"].tolist() for p in parts] == [[g] for g in whole["image_grid_thw"].tolist()]
    for row, part in enumerate(parts):
        assert torch.equal(part["position_ids"][:, 0], whole["position_ids"][:, row])
    assert multimodal_forward_kwargs(Batch({"input_ids": batch["input_ids"]})) == {}
    # The logits of a row do not depend on the other row of the micro-batch.
    model.eval()
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **whole).logits
    one = model(input_ids=batch["input_ids"][1:], attention_mask=batch["attention_mask"][1:], **parts[1]).logits
    assert torch.allclose(full[1:, -RESPONSE:], one[:, -RESPONSE:], atol=1e-4)


@pytest.mark.parametrize("frozen", [False, True])
def test_forward_backward_left_padded(vl: tuple[Any, Any], frozen: bool) -> None:
    processor, model = vl
    model.train()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(True)
    if frozen:
        assert freeze_vision_tower(model) > 0
    batch = _batch(processor)
    kwargs = multimodal_forward_kwargs(batch, model)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, **kwargs
    ).logits
    logp = torch.log_softmax(logits[:, -RESPONSE - 1 : -1].float(), dim=-1)
    loss = -logp.gather(-1, batch["responses"].unsqueeze(-1)).mean()
    loss.backward()
    assert torch.isfinite(loss)
    lm_grads = [p.grad for n, p in model.named_parameters() if "language_model" in n]
    assert lm_grads and all(g is not None and torch.isfinite(g).all() for g in lm_grads)
    visual = vision_tower(model)
    assert visual is not None
    vision_grads = [p.grad for p in visual.parameters()]
    if frozen:
        assert all(g is None for g in vision_grads)
    else:
        assert any(g is not None and g.abs().sum() > 0 for g in vision_grads)


def test_generate_with_media_left_padded_repeated(vl: tuple[Any, Any]) -> None:
    processor, model = vl
    model.eval()
    batch = _batch(processor).repeat_interleave(2)  # n=2 samples per prompt: media repeated with the rows
    width = batch["input_ids"].shape[1] - RESPONSE
    out = generate_with_media(
        model,
        batch["input_ids"][:, :width],
        batch["attention_mask"][:, :width],
        batch["multi_modal_inputs"],
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    assert out.shape == (4, width + 3)
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3])  # greedy: repeats agree


def test_media_tokens_are_never_generated_and_mismatches_are_explained(vl: tuple[Any, Any]) -> None:
    processor, model = vl
    model.eval()
    batch = _batch(processor)
    width = batch["input_ids"].shape[1] - RESPONSE
    image_id = model.config.image_token_id
    # Make the image pad the most likely next token: generation must still not produce it.
    with torch.no_grad():
        model.lm_head.weight[image_id] += 50.0
    try:
        out = generate_with_media(
            model,
            batch["input_ids"][:, :width],
            batch["attention_mask"][:, :width],
            batch["multi_modal_inputs"],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    finally:
        with torch.no_grad():
            model.lm_head.weight[image_id] -= 50.0
    assert not (out[:, width:] == image_id).any()
    bad = Batch(
        {"input_ids": batch["input_ids"].clone(), "attention_mask": batch["attention_mask"]},
        {"multi_modal_inputs": batch["multi_modal_inputs"]},
    )
    bad["input_ids"][0, -1] = image_id  # a response token that looks like an image slot
    with pytest.raises(ValueError, match="vision special tokens"):
        multimodal_forward_kwargs(bad, model)
