"""The rollout engine takes the vision tower's outputs the actor holds instead of pixels (easyrl.rollout.media_embeds):
the same greedy tokens and log-probs as from pixels, and the engine's own tower never runs; pixels (counted, said
once) when the tower is trained or an item was never encoded."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from easyrl.batch import Batch
from easyrl.data.multimodal import encode_multimodal_prompt
from easyrl.models import load_processor, vision_tower
from easyrl.models.embed_cache import tower_version
from easyrl.models.vl_embeds import EmbedReuse, install_embed_reuse, tower_settings
from easyrl.rollout import SamplingParams
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.media_embeds import MEDIA_KINDS, MediaEmbeds, row_embeds
from easyrl.seeding import SEED_COLUMN
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from tests.models.test_vl_embeds import DATA_CFG, write_video
from tests.recipes.base import KV_CACHE_BYTES


GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=6, logprobs=True)


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Batch, Path]:
    root = tmp_path_factory.mktemp("vl")
    path = build_tiny_vl_checkpoint(root / request.param, request.param)
    processor = load_processor(path)
    return path, processor, _prompts(processor, root), root


def _prompts(processor: Any, root: Path, seed: int = 3) -> Batch:
    """Three left-padded prompts: an image; an image and a video; text only (`seed`: the media's content)."""
    video = write_video(root / f"clip{seed}.mp4", seed=seed)
    specs: list[tuple[str, list[Image.Image], list[str]]] = [
        ("Shape? <image>", [Image.new("RGB", (64, 48), (255, seed, 0))], []),
        ("Same as <image> in <video>?", [Image.new("RGB", (32, 32), (0, 9, seed))], [video]),
        ("What is 2+2?", [], []),
    ]
    encoded = [
        encode_multimodal_prompt(processor, [{"role": "user", "content": text}], images, videos, DATA_CFG)
        for text, images, videos in specs
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(encoded), width), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, width - len(e["input_ids"]) :] = torch.tensor(e["input_ids"])
        mask[row, width - len(e["input_ids"]) :] = 1
    media = [e.get("multi_modal_inputs") or None for e in encoded]
    tensors = {"input_ids": ids, "attention_mask": mask, SEED_COLUMN: torch.arange(len(encoded))}
    return Batch(tensors, {"multi_modal_inputs": media})


def _actor_encodings(path: str, prompts: Batch, frozen: bool = True) -> EmbedReuse:
    """The actor's side, for real: a policy model of its own with `EmbedReuse` installed, encoding every item of the
    prompts once (as its old-log-prob pass would), which keeps a frozen tower's outputs in the memo."""
    actor = AutoModelForImageTextToText.from_pretrained(path).eval()
    tower = vision_tower(actor)
    assert tower is not None
    version = tower_version(tower) if frozen else None
    reuse = install_embed_reuse(actor, version, None, tower_settings(actor) | {"compute_dtype": "fp32"})
    assert reuse is not None
    with torch.no_grad():
        for media in prompts["multi_modal_inputs"]:
            for _, patches, grid in MEDIA_KINDS:
                if media and patches in media:
                    reuse.features(media[patches], media[grid])
    return reuse


def _engine(path: str, processor: Any) -> tuple[HFRolloutEngine, list[int]]:
    tok = processor.tokenizer
    engine = HFRolloutEngine(path, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)
    calls = [0]
    tower = vision_tower(engine.model)
    assert tower is not None
    tower.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return engine, calls


def test_hf_engine_generates_from_held_embeddings_as_from_pixels(vl: tuple[str, Any, Batch, Path]) -> None:
    path, processor, prompts, _ = vl
    engine, calls = _engine(path, processor)
    expected = engine.generate(prompts, GREEDY)
    assert calls[0] == 2  # pixels: the engine's tower ran, once per media kind of the call
    assert expected["rollout_log_probs"].abs().sum() > 0

    engine.media_embeds = MediaEmbeds(_actor_encodings(path, prompts))
    calls[0] = 0
    got = engine.generate(prompts, GREEDY)
    assert calls[0] == 0, "the engine ran its vision tower although every item's embeddings were given"
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5, rtol=1e-5)
    # per prompt: two images and one video went as embeddings, none as pixels
    assert engine.media_embeds.counts() == {"perf/rollout_items_as_embeds": 3, "perf/rollout_items_as_pixels": 0}


def test_trained_tower_or_unencoded_items_go_as_pixels(
    vl: tuple[str, Any, Batch, Path], caplog: pytest.LogCaptureFixture
) -> None:
    path, processor, prompts, root = vl
    engine, calls = _engine(path, processor)
    expected = engine.generate(prompts, GREEDY)
    # a trained tower: the held outputs would be a step stale, so nothing is taken from it
    engine.media_embeds = MediaEmbeds(_actor_encodings(path, prompts, frozen=False))
    calls[0] = 0
    with caplog.at_level(logging.INFO, logger="easyrl.rollout.media_embeds"):
        got = engine.generate(prompts, GREEDY)
        engine.generate(prompts, GREEDY)
    assert calls[0] == 4
    assert torch.equal(got["responses"], expected["responses"])
    assert engine.media_embeds.counts() == {"perf/rollout_items_as_embeds": 0, "perf/rollout_items_as_pixels": 6}
    said = [r.getMessage() for r in caplog.records if "as pixels" in r.getMessage()]
    assert len(said) == 1 and "the vision tower is trained" in said[0], said  # once, with the reason

    # a frozen tower that encoded only the first prompt's image of new media: the second prompt's image and video
    # were never encoded (its images go as pixels with the first's: a kind goes one way per call)
    fresh = _prompts(processor, root, seed=50)
    engine.media_embeds = MediaEmbeds(_actor_encodings(path, fresh.slice(0, 1)))
    calls[0] = 0
    engine.generate(fresh, GREEDY)
    assert calls[0] == 2
    assert engine.media_embeds.counts() == {"perf/rollout_items_as_embeds": 0, "perf/rollout_items_as_pixels": 3}
    engine.generate(fresh.slice(0, 1), GREEDY)  # the first prompt alone: all its items held
    assert calls[0] == 2
    assert engine.media_embeds.counts() == {"perf/rollout_items_as_embeds": 1, "perf/rollout_items_as_pixels": 0}


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def _video_row(tmp_path: Path, arch: str, **model_kwargs: Any) -> tuple[str, Any, dict[str, Any]]:
    """A dataset row with a video (6 frames at 2 fps: temporal patches 1 s apart) and an image, as the trainer
    hands it to the engine: the unexpanded vLLM prompt with pixels, and the actor's processed media."""
    from tests.data.test_multimodal import _write_video
    from tests.workers.test_rollout_vl_vllm import _dataset

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch, **model_kwargs)
    _write_video(tmp_path / "clip.mp4")
    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "red.png")
    rows = [{"prompt": "<video> then <image>?", "answer": "x", "videos": ["clip.mp4"], "images": ["red.png"]}]
    ds = _dataset(tmp_path, model, rows, min_pixels=16 * 16, max_pixels=48 * 48, video_fps=2.0, max_frames=8)
    return model, ds.processor, ds[0]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vllm_request_carries_held_embeddings_instead_of_pixels(tmp_path: Path, arch: str) -> None:
    """What the vLLM engine is handed for a row whose items the actor holds: vLLM's embedding inputs (the outputs
    and grids, no pixels), from which it expands the slots to the actor's prompt. Qwen3-VL's tower has deepstack
    outputs, which this route does not carry: its rows go as pixels, said once."""
    from easyrl.rollout.vllm import embeds_refusal, vllm_request
    from tests.workers.test_rollout_vl_vllm import _slot_ids

    model, processor, item = _video_row(tmp_path, arch)
    processed = item["multi_modal_inputs"]
    reuse = _actor_encodings(model, Batch({}, {"multi_modal_inputs": [processed]}))
    embeds = MediaEmbeds(reuse)
    held = row_embeds(embeds, processed, embeds_refusal(None, processed))
    if arch != "qwen2_5_vl":
        assert held is None and embeds.counts()["perf/rollout_items_as_pixels"] == 2
        return
    assert torch.equal(processed["second_per_grid_ts"], torch.tensor([1.0]))
    assert held is not None and embeds.counts()["perf/rollout_items_as_embeds"] == 2
    request = vllm_request(item["prompt_ids"], item["rollout_prompt"], _slot_ids(processor), held)
    data = request["multi_modal_data"]
    assert set(data) == {"image", "video"} and "mm_processor_kwargs" not in request
    for kind, patches, grid in MEDIA_KINDS:
        outputs = reuse.lookup(processed[patches], processed[grid][0])
        assert outputs is not None
        assert torch.equal(data[kind][f"{kind}_embeds"], outputs[0])
        assert torch.equal(data[kind][f"{kind}_grid_thw"], processed[grid])
    # vLLM sizes each slot from its grid alone: one pad per merged patch
    slots = {token: kind for kind, token in _slot_ids(processor).items()}
    grids = {kind: iter(data[kind][f"{kind}_grid_thw"].tolist()) for kind in data}
    expanded = []
    for token in request["prompt_token_ids"]:
        t, h, w = next(grids[slots[token]]) if token in slots else (0, 0, 0)
        expanded += [token] * (t * h * w // 4) if token in slots else [token]
    assert expanded == item["prompt_ids"]
    # vLLM's video embeddings are placed 1 s per temporal patch: at another spacing the row keeps its pixels
    assert "not 1 s apart" in str(embeds_refusal(None, processed | {"second_per_grid_ts": torch.tensor([0.5])}))
    with pytest.raises(ValueError, match="embeddings for"):  # every kind of the row, or none
        vllm_request(item["prompt_ids"], item["rollout_prompt"], _slot_ids(processor), {"image": held["image"]})


@pytest.mark.gpu
@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_generates_from_held_embeddings_as_from_pixels(tmp_path: Path) -> None:
    """The real vLLM engine (GPU: its CPU build cannot load Qwen-VL models here) given the actor's held outputs of a
    row's video and image: the greedy tokens it gives from pixels, its vision tower never run."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from easyrl.config import EasyRLConfig
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec

    # head size 32 in the language model and the tower (vLLM's attention kernels reject 16)
    model, processor, item = _video_row(tmp_path, "qwen2_5_vl", num_heads=2, num_kv_heads=1, vision_hidden_size=64)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model
    cfg.worker.actor.model.freeze_vision_tower = True
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, GREEDY.max_tokens
    cfg.worker.rollout.logprob_sample_ratio = 1.0
    cfg.worker.rollout.dtype = "fp32"
    # as the recipe matrix runs engines side by side on one GPU (tests/recipes/base.py): a sized KV cache (no start-up
    # profile, which vLLM refuses while another process's memory moves) and no graph capture (start-up time)
    cfg.worker.rollout.gpu_memory_utilization = 0.05
    cfg.worker.rollout.enforce_eager = True
    cfg.worker.rollout.engine_kwargs = {"kv_cache_memory_bytes": KV_CACHE_BYTES}
    tok = processor.tokenizer
    spec = rollout_spec(cfg, plan_of(cfg))
    engine = VLLMRolloutEngine(spec, [tok.eos_token_id], tok.pad_token_id, {"image": 1, "video": 1})
    ids = torch.tensor([item["prompt_ids"]])
    prompts = Batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), SEED_COLUMN: torch.zeros(1, dtype=torch.long)},
        {"multi_modal_inputs": [item["multi_modal_inputs"]], "rollout_prompt": [item["rollout_prompt"]]},
    )
    core: Any = engine.llm.llm_engine.engine_core.engine_core
    calls = [0]
    tower = core.model_executor.driver_worker.worker.model_runner.get_model().visual
    tower.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    expected = engine.generate(prompts, GREEDY)
    assert calls[0] > 0
    engine.llm.reset_mm_cache()  # the pixels' encoder outputs must not serve the second call
    engine.media_embeds = MediaEmbeds(_actor_encodings(model, prompts))
    calls[0] = 0
    got = engine.generate(prompts, GREEDY)
    assert calls[0] == 0, "vLLM ran its vision tower although every item's embeddings were given"
    assert engine.media_embeds.counts()["perf/rollout_items_as_embeds"] == 2
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-3, rtol=1e-3)
