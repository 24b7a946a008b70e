"""The long-sample memory plan (easyrl/long_sample_plan.py) of Qwen2.5-VL-7B on an hour of video (3,600 frames,
~256k tokens: Long-RL's headline setting) against figures computed by hand from its published config.json (built
here: nothing downloads), and `easyrl check`'s refusal, with the levers, of a layout the sample cannot fit."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from transformers import Qwen2_5_VLConfig

from easyrl.config import EasyRLConfig
from easyrl.long_sample_plan import (
    VisionShape,
    long_sample_problem,
    plan_long_sample,
    video_token_bound,
    vision_encode_bytes,
)
from easyrl.memory_plan import GiB, ModelShape, plan_memory
from tests.conftest import REPO


H100 = 80 * GiB
TEXT_7B = {  # Qwen2.5-VL-7B-Instruct's config.json, the fields the plan reads
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
VISION_7B = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "in_channels": 3,
}
RECIPE = REPO / "configs" / "long_video" / "hour_video_grpo_qwen2_5_vl_7b.yaml"
T = 262144  # the recipe's max_prompt_length 260096 + max_response_length 2048
VIDEO_TOKENS = 259200  # 1,800 temporal patches of 252x448 pixels: 9 x 16 merged tokens each


def _hf() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(text_config=TEXT_7B, vision_config=VISION_7B, tie_word_embeddings=False)


def _config(**sections: Any) -> EasyRLConfig:
    base = OmegaConf.structured(EasyRLConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create(sections)))  # type: ignore[return-value]


def _recipe(*overrides: str) -> EasyRLConfig:
    """The recipe's settings with the 7B shape's config (its data and model paths are not read by the plan)."""
    raw = OmegaConf.to_container(OmegaConf.load(RECIPE))
    assert isinstance(raw, dict)
    for key in ("train_files", "val_files", "video_dir"):
        raw["data"].pop(key, None)
    raw["worker"]["actor"]["model"].pop("model_path")
    raw["worker"]["reward"].pop("reward_function")
    cfg = OmegaConf.merge(
        OmegaConf.structured(EasyRLConfig), OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides))
    )
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_hf_config(_hf())


def test_video_tokens_of_an_hour_by_hand() -> None:
    """The pixel budget is shared by the clip: 203,212,800 pixels over 28x28-pixel merged tokens is 259,200 tokens,
    i.e. 1,800 temporal patches (3,600 frames) of 144 tokens; never more than the sample, at least one a patch."""
    vision = VisionShape.from_hf_config(_hf())
    assert vision == VisionShape(1280, 32, 3420, 14, 2, 2, out_hidden_size=3584)
    cfg = _recipe()
    assert (cfg.data.max_frames, cfg.data.max_pixels) == (3600, 203212800)
    assert video_token_bound(cfg, vision, T) == 203212800 // 784 == VIDEO_TOKENS == 1800 * 144
    assert video_token_bound(cfg, vision, 1000) == 1000
    assert video_token_bound(_recipe("data.max_pixels=784"), vision, T) == 1800
    assert video_token_bound(cfg, None, T) == 0


def test_vision_encode_by_hand() -> None:
    """Frozen tower on one rank: fp32 patches P x 3 x 2 x 14 x 14 x 4 plus one block's working set
    P x (6 x 1280 + 3 x 3420) x 2 plus the output, 259,200 tokens x 3584 x 2; a trained tower also keeps 32 block
    inputs P x 1280 x 2. Over 4 sequence-parallel ranks each encodes a quarter of the patches and gets the whole
    output back from the all-gather."""
    vision = VisionShape.from_hf_config(_hf())
    patches = VIDEO_TOKENS * 4
    pixels = patches * 1176 * 4
    working = patches * (7680 + 10260) * 2
    output = VIDEO_TOKENS * 3584 * 2
    assert output == 1_857_945_600
    one_rank = vision_encode_bytes(vision, VIDEO_TOKENS, 2, trained=False)
    assert one_rank == pixels + working + output == 43_935_436_800
    trained = vision_encode_bytes(vision, VIDEO_TOKENS, 2, trained=True)
    assert trained == pixels + working + 32 * patches * 1280 * 2 + output
    quarter = vision_encode_bytes(vision, VIDEO_TOKENS, 2, trained=False, sp_size=4)
    assert quarter == (pixels + working) // 4 + output == 12_377_318_400


def test_recipe_plan_by_hand(shape: ModelShape) -> None:
    """Ulysses 4 (it must divide the 28 heads) on 8 GPUs: 65,536 tokens a rank; activations with gradient
    checkpointing L x t x H x 2 plus one layer's working set t x (3H + 2Q + 2KV + 3I) x 2 plus the fused head's chunk
    1024 x V x 8, its weight gradient in bf16 V x H x 2 (written by blocks of vocabulary columns) and, over those
    blocks, the hidden states' gradient t x H x (4 + 2) (an fp32 sum and one block's bf16 product)."""
    cfg = _recipe()
    plan = plan_long_sample(shape, VisionShape.from_hf_config(_hf()), cfg, H100)
    assert (plan.sample_tokens, plan.ulysses_size, plan.ring_size, plan.tokens_per_rank) == (T, 4, 1, 65536)
    t = 65536
    checkpointed = 28 * t * 3584 * 2
    working = t * (3 * 3584 + 2 * 3584 + 2 * 512 + 3 * 18944) * 2
    head = 1024 * 152064 * 8 + 152064 * 3584 * 2 + t * 3584 * 6
    assert plan.activations == checkpointed + working + head == 26_830_438_400
    assert plan.ring_buffers == 0
    # the update is the ordinary plan's with one micro-batch of the rank's share (the recipe's own token budget)
    assert plan.update == plan_memory(shape, cfg, H100).updating
    # in it, FSDP2's bf16 gathered copies at the head's backward: the untied embedding and head with the final norm
    # (2 x 152064 x 3584 + 3584) and two of the 28 decoder layers (the text model's 7.62B less the root, / 28)
    root = 2 * 152064 * 3584 + 3584
    layer = (8_292_166_656 - 676_550_144 - root) // 28
    assert plan_memory(shape, cfg, H100).actor.gathered == (root + 2 * layer) * 2 == 3_112_227_840
    # engine KV for the sample: 2 x 28 layers x 4/2 heads (tensor parallel 2) x 128 x 2 bytes a token
    assert plan.kv_sample == T * 2 * 28 * 2 * 128 * 2 == 7 * GiB
    assert plan.kv_sample < plan.kv_cache
    assert plan.vision_encode == 12_377_318_400  # a quarter of the frames a rank (Ulysses 4), the whole output
    assert plan.fits and plan.per_rank < H100 and long_sample_problem(plan) is None
    assert 52.5 * GiB < plan.per_rank < 53 * GiB  # docs/vision_language.md: 52.6 of 80 GiB


def test_ring_splits_the_tokens_and_adds_its_blocks(shape: ModelShape) -> None:
    """Ulysses 4 x ring 2 holds half the tokens a rank of Ulysses 4 alone, plus the key/value block in flight and
    the one arriving: 2 x t x 2 x KV x 2 bytes."""
    cfg = _recipe()
    cfg.worker.actor.ring_size = 2
    plan = plan_long_sample(shape, None, cfg, H100)
    assert (plan.ulysses_size, plan.ring_size, plan.tokens_per_rank) == (4, 2, 32768)
    assert plan.ring_buffers == 2 * 32768 * 2 * 512 * 2 == 134_217_728
    single = plan_long_sample(shape, None, _recipe(), H100)
    assert plan.activations < single.activations and plan.vision_encode == single.vision_encode == 0


def test_a_sample_that_cannot_fit_is_refused_with_the_levers(shape: ModelShape) -> None:
    """Without sequence parallelism one rank holds all 262,144 tokens: ~200 GiB of activations."""
    plan = plan_long_sample(shape, VisionShape.from_hf_config(_hf()), _recipe("worker.actor.ulysses_size=1"), H100)
    assert plan.tokens_per_rank == T and not plan.fits
    problem = long_sample_problem(plan)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("a sample of 262144 tokens (data.max_prompt_length + data.max_response_length) needs")
    assert "GiB per rank (bound 80.0 GiB) with ulysses 1 x ring 1 (262144 tokens per rank)" in problem
    assert "raise worker.actor.ulysses_size or worker.actor.ring_size" in problem
    assert "lower data.max_frames, data.video_fps or data.max_pixels" in problem
    # the engine's side: a KV cache too small for the sample names the engine's levers
    small = plan_long_sample(shape, None, _recipe("worker.rollout.gpu_memory_utilization=0.15"), H100)
    assert small.kv_sample > small.kv_cache
    assert "raise worker.rollout.tensor_parallel_size or gpu_memory_utilization" in (long_sample_problem(small) or "")


def test_check_prints_the_long_sample_plan_and_refuses(tmp_path: Path) -> None:
    """`easyrl check --gpu-memory 80` on the recipe (the 7B's config.json only: nothing is downloaded)."""
    from easyrl.check import print_memory_plan

    model = tmp_path / "qwen2_5_vl_7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_hf().to_dict()))
    # Ulysses 4: each rank encodes a quarter of the frames (11.5 GiB); one rank: the whole clip (40.9 GiB)
    for overrides, code, encode in (((), 0, "11.5"), (("worker.actor.ulysses_size=1",), 2, "40.9")):
        cfg = _recipe(f"worker.actor.model.model_path={model}", *overrides)
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            assert print_memory_plan(cfg, gpu_memory_gib=80) == code
        assert "long sample: 262144 tokens over ulysses" in out.getvalue()
        assert f"vision tower encode {encode} (259200 video tokens, frames split over the group)" in out.getvalue()
        assert ("easyrl: memory error: a sample of 262144 tokens" in err.getvalue()) == (code == 2)


def test_short_samples_get_no_long_sample_plan(tiny_model_dir: str) -> None:
    from easyrl.check import long_sample_refusal, memory_plan_lines

    cfg = _config(worker={"actor": {"model": {"model_path": tiny_model_dir}}})

    lines, _ = memory_plan_lines(cfg, gpu_memory_gib=80)
    assert lines and not any(line.startswith("long sample") for line in lines)
    assert long_sample_refusal(cfg) is None


def test_recipe_passes_check_offline_with_local_stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`easyrl check --gpu-memory 80` on the recipe as a user runs it, the hub model and dataset swapped for a tiny
    Qwen2.5-VL that claims the 7B's 128k x 2 context and one 1,000-frame video row (nothing downloads)."""
    import random

    from easyrl.check import run_check
    from easyrl.config import load_config
    from easyrl.testing.long_video import colour_segments, write_colour_video
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    model = Path(build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl"))
    config = json.loads((model / "config.json").read_text())
    for section in (config, config.get("text_config", {})):
        if "max_position_embeddings" in section:
            section["max_position_embeddings"] = T
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "videos").mkdir()
    write_colour_video(tmp_path / "videos" / "hour.mp4", colour_segments(random.Random(0), 1000, 100))
    row = {"problem": "<video>What colour is last?", "answer": "red", "videos": ["hour.mp4"]}
    (tmp_path / "train.jsonl").write_text((json.dumps(row) + "\n") * 8)  # a step of 8 prompts
    monkeypatch.chdir(REPO)  # the recipe names its template and reward file from the repository root
    overrides = [
        f"worker.actor.model.model_path={model}",
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.video_dir={tmp_path / 'videos'}",
        "trainer.device=auto",  # a CPU login node planning the GPU run: engine problems only warn
    ]
    cfg = load_config(RECIPE, overrides)
    out = io.StringIO()
    with redirect_stdout(out):
        code = run_check(cfg, gpu_memory_gib=80)
    assert code == 0, out.getvalue()[-3000:]
    assert (
        "== memory plan" in out.getvalue() and "long sample: 262144 tokens over ulysses 4 x ring 1" in out.getvalue()
    )
