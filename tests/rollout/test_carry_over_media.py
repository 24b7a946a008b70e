"""Carry-over (`trainer.max_staleness >= 1`) with images and video: a response continued over several engine calls
gets its prompt's media with every call, the model places its tokens at the positions the first call used, and
the rows handed to the trainer are those of the synchronous loop (plus the async columns)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from easyrl.batch import Batch
from easyrl.data.multimodal import encode_multimodal_prompt
from easyrl.models import load_processor, mrope_position_ids, stack_media
from easyrl.rollout import SamplingParams, SingleTurnLoop
from easyrl.rollout.carry_over import CarryOverLoop
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.trajectory import columns_from_state, columns_state
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from tests.rollout.test_multi_turn import LocalEngines


DATA_CFG = SimpleNamespace(min_pixels=16 * 16, max_pixels=64 * 64, video_fps=2.0, max_frames=8, limit_images=0)
RESPONSE, CHUNK = 6, 2
ASYNC_ONLY = {"token_policy_version", "rollout_sessions"}  # the columns only `rows_of` adds


class RecordingEngines(LocalEngines):
    """The in-process HF engine, keeping every request it was given."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        super().__init__(engine, count=1)
        self.requests: list[Batch] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.requests.append(prompts)
        return super().generate(prompts, params)

    def policy_version(self) -> int:
        return 0  # every row is stamped 0 (`LocalEngines`)


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    path = build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / request.param, request.param)
    return path, load_processor(path), AutoModelForImageTextToText.from_pretrained(path)


def _prompts(processor: Any) -> Batch:
    """Two left-padded prompts with an image each (different sizes), with the columns the dataset gives them:
    `multi_modal_inputs` (the HF engine's) and `rollout_prompt` (vLLM's: unexpanded ids and the pixels)."""
    specs = [
        ("Shape? <image>", (64, 48), (255, 0, 0)),
        ("Which colour is this one <image> here?", (32, 32), (0, 0, 9)),
    ]
    encoded = [
        encode_multimodal_prompt(
            processor, [{"role": "user", "content": text}], [Image.new("RGB", size, rgb)], [], DATA_CFG
        )
        for text, size, rgb in specs
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((2, width), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, width - len(e["input_ids"]) :] = torch.tensor(e["input_ids"])
        mask[row, width - len(e["input_ids"]) :] = 1
    rollout_prompts = [
        {
            "prompt_token_ids": processor.tokenizer(e["prompt"], add_special_tokens=False)["input_ids"],
            "multi_modal_data": {"image": [np.asarray(img) for img in e["images"]]},
        }
        for e in encoded
    ]
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
        {
            "multi_modal_inputs": [e["multi_modal_inputs"] for e in encoded],
            "rollout_prompt": rollout_prompts,
            "uid": ["a", "b"],
        },
    )


def _positions(model: Any, batch: Batch) -> list[torch.Tensor]:
    """Each row's 3D rope positions over its real tokens (3, L_i), as the model computes them from ids and grids."""
    grids = stack_media(batch["multi_modal_inputs"])["image_grid_thw"]
    pos = mrope_position_ids(model, batch["input_ids"], batch["attention_mask"], grids)
    return [pos[:, i, batch["attention_mask"][i].bool()] for i in range(len(batch))]


def test_a_continued_vl_request_gives_the_engine_the_same_media_and_positions(vl: tuple[str, Any, Any]) -> None:
    path, processor, model = vl
    tok = processor.tokenizer
    engine = HFRolloutEngine(path, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)
    prompts = _prompts(processor)
    # greedy: the one-call and the chunked runs must pick the same tokens, which they do only if the continued calls
    # see the same pixels at the same positions
    params = SamplingParams(n=2, temperature=0.0, max_tokens=RESPONSE, seed=7, logprobs=True)

    sync = RecordingEngines(engine)
    expected, _ = SingleTurnLoop().run(sync, prompts, params)

    engines = RecordingEngines(engine)
    loop = CarryOverLoop(
        lambda k: pytest.fail("the step's own prompts fill the admission room"),
        max_staleness=1,
        active_groups=2,
        chunk_tokens=CHUNK,
        max_response_length=RESPONSE,
        stop_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        engines=1,
    )
    rows, _ = loop.run(engines, prompts, params)

    # the engine's calls: every row of every call carries its prompt's media; a continuation's vLLM prompt is the
    # unexpanded prompt followed by the tokens so far, with the same pixels
    assert len(engines.requests) >= 2, "the responses were not cut into chunks"
    continued = 0
    final_positions = _positions(model, expected)
    for request in engines.requests:
        request_positions = _positions(model, request)
        for i in range(len(request)):
            ids = request["input_ids"][i][request["attention_mask"][i].bool()].tolist()
            p = next(p for p in range(2) if ids[: int(prompts["attention_mask"][p].sum())] == _real(prompts, p))
            assert request["multi_modal_inputs"][i] is prompts["multi_modal_inputs"][p]
            sent = request["rollout_prompt"][i]
            own = prompts["rollout_prompt"][p]
            so_far = ids[len(_real(prompts, p)) :]
            assert sent["prompt_token_ids"] == own["prompt_token_ids"] + so_far
            assert sent["multi_modal_data"] is own["multi_modal_data"]
            # the context's positions are those its tokens have in the finished row (the trainer's)
            row = next(r for r in range(len(expected)) if _real(expected, r)[: len(ids)] == ids)
            assert torch.equal(request_positions[i], final_positions[row][:, : len(ids)])
            continued += bool(so_far)
    assert continued, "no call continued a response"

    assert torch.equal(rows["responses"], expected["responses"])
    assert torch.allclose(rows["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-4)
    assert int(rows["rollout_sessions"].max()) == 1  # one session: the chunks of one step
    # the rows the trainer gets: the synchronous loop's columns, the same values, plus the async record
    assert _keys(rows) - _keys(expected) == ASYNC_ONLY
    assert _keys(expected) <= _keys(rows)
    for key in expected.tensors:
        if key != "rollout_log_probs":
            assert torch.equal(rows[key], expected[key]), key
    for key in expected.non_tensors:
        assert all(a is b for a, b in zip(rows[key], expected[key], strict=True)), key  # the prompt's own objects


def _real(batch: Batch, row: int) -> list[int]:
    return batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()


def _keys(batch: Batch) -> set[str]:
    return {*batch.tensors, *batch.non_tensors}


def _loop(tok: Any) -> CarryOverLoop:
    return CarryOverLoop(
        lambda k: pytest.fail("no prompt is drawn"),
        max_staleness=1,
        active_groups=2,
        chunk_tokens=CHUNK,
        max_response_length=RESPONSE,
        stop_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        engines=2,
    )


def test_media_in_flight_survive_a_checkpoint(vl: tuple[str, Any, Any]) -> None:
    """The state of groups in flight goes through JSON (the trainer's checkpoint) and gives the same next request:
    same ids, pixels, grids and vLLM prompt."""
    _, processor, _ = vl
    tok = processor.tokenizer
    params = SamplingParams(n=2, temperature=1.0, max_tokens=RESPONSE, seed=7, logprobs=True)
    loop = _loop(tok)
    loop.enqueue(_prompts(processor), params, offset=0)
    loop.queue[1].samples[0].append([40, 41, 42], True, [-0.5, -0.25, -0.125], 0)  # a response under way
    resumed = _loop(tok)
    resumed.load_state_dict(json.loads(json.dumps(loop.state_dict())))
    work = [(g, j) for g in loop.queue for j in range(2)]
    again = [(g, j) for g in resumed.queue for j in range(2)]
    first, _ = loop.request_for(work, params)
    second, _ = resumed.request_for(again, params)
    for key in first.tensors:
        assert torch.equal(first[key], second[key]), key
    for a, b in zip(first["multi_modal_inputs"], second["multi_modal_inputs"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    for a, b in zip(first["rollout_prompt"], second["rollout_prompt"], strict=True):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert all(
            np.array_equal(x, y) for x, y in zip(a["multi_modal_data"]["image"], b["multi_modal_data"]["image"])
        )
    assert second["rollout_prompt"][2]["prompt_token_ids"][-3:] == [40, 41, 42]


def test_a_videos_columns_survive_the_checkpoint_codec() -> None:
    """A video prompt's columns (bf16 patches, a vLLM (frames, metadata) pair with numpy frame indices) come back
    equal from JSON."""
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    meta = {"fps": 2.0, "frames_indices": [np.int64(0), np.int64(3)], "video_backend": "pyav"}
    columns = {
        "multi_modal_inputs": {
            "pixel_values_videos": torch.randn(4, 6).to(torch.bfloat16),
            "video_grid_thw": torch.tensor([[1, 2, 2]]),
        },
        "rollout_prompt": {"prompt_token_ids": [1, 2], "multi_modal_data": {"video": [(frames, meta)]}},
        "uid": "v",
    }
    back = columns_from_state(json.loads(json.dumps(columns_state(columns))))
    for key, value in columns["multi_modal_inputs"].items():
        got = back["multi_modal_inputs"][key]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    ((got_frames, got_meta),) = back["rollout_prompt"]["multi_modal_data"]["video"]
    assert got_frames.dtype == np.uint8 and np.array_equal(got_frames, frames)
    assert got_meta == {"fps": 2.0, "frames_indices": [0, 3], "video_backend": "pyav"}
    assert back["uid"] == "v" and back["rollout_prompt"]["prompt_token_ids"] == [1, 2]
