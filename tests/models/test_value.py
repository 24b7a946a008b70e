"""The VL critic: the policy checkpoint's backbone plus a value head, fed the same media as the actor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText

from easyrl.batch import Batch
from easyrl.models import load_processor, vision_tower
from easyrl.models.value import VisionValueModel
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from easyrl.workers.forward_backward import response_values
from tests.models.test_vision import RESPONSE, _batch


@pytest.fixture(scope="module", params=VL_ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / request.param, request.param)


def test_backbone_is_the_policys(checkpoint: str) -> None:
    policy = AutoModelForImageTextToText.from_pretrained(checkpoint)
    critic = VisionValueModel.from_pretrained(checkpoint)
    theirs = {k: v for k, v in policy.state_dict().items() if k.startswith("model.")}
    ours = {k: v for k, v in critic.state_dict().items() if k.startswith("model.")}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert critic.score.weight.shape == (1, policy.config.text_config.hidden_size)
    assert "lm_head.weight" not in critic.state_dict()


def test_values_see_each_rows_pixels_and_train_the_tower(checkpoint: str) -> None:
    processor = load_processor(checkpoint)
    critic: Any = VisionValueModel.from_pretrained(checkpoint)
    batch = _batch(processor)
    mask = torch.ones(2, RESPONSE, dtype=torch.long)
    batch = Batch({**batch.tensors, "response_mask": mask}, batch.non_tensors)
    values = response_values(critic, batch, torch.device("cpu"))
    assert values.shape == (2, RESPONSE) and torch.isfinite(values).all()

    media = [dict(m) for m in batch["multi_modal_inputs"]]
    media[0]["pixel_values"] = media[0]["pixel_values"] + 1.0  # other pixels in row 0 only
    changed = response_values(critic, Batch(batch.tensors, {"multi_modal_inputs": media}), torch.device("cpu"))
    assert not torch.allclose(changed[0], values[0])
    assert torch.allclose(changed[1], values[1], atol=1e-6)

    response_values(critic, batch, torch.device("cpu")).sum().backward()
    tower = vision_tower(critic)
    assert tower is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.parameters())
    assert critic.score.weight.grad is not None and critic.score.weight.grad.abs().sum() > 0
