"""A video RL run with a frozen vision tower and `data.cache_dir` equals the run without it (rewards, log-probs,
losses), encodes each video once per run (the second epoch and every later pass reuse it), and a fresh run on the
filled cache encodes nothing; the HF engine takes the held outputs instead of pixels wherever the actor holds them:
2 FSDP2 workers, tiny Qwen2.5-VL, CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
from tests.models.test_vl_embeds import write_video
from tests.trainer.test_e2e import run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py

VIDEOS = 2  # one step an epoch (2 prompts a step): epoch 2 must reuse what step 1 encoded


def _video_data(folder: Path) -> dict[str, str]:
    videos = folder / "videos"
    videos.mkdir(parents=True)
    rows = []
    for i in range(VIDEOS):
        write_video(videos / f"v{i}.mp4", seed=i, frames=8)
        rows.append({"prompt": f"<video>How many digits are in {i}{i}?", "answer": "2", "videos": [f"v{i}.mp4"]})
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": str(train), "video_dir": str(videos)}


def _edits(data: dict[str, str]) -> dict[str, object]:
    return {
        "data.video_dir": data["video_dir"],
        "data.max_prompt_length": 160,
        "data.min_pixels": 16 * 16,
        "data.max_pixels": 48 * 48,
        "data.video_fps": 4.0,
        "data.max_frames": 8,
        "data.rollout_batch_size": 2,
        "data.shuffle": False,
        "trainer.total_epochs": 2,
        "worker.actor.model.freeze_vision_tower": True,
    }


def _compared(row: dict[str, float]) -> dict[str, float]:
    """What the run computed (rewards, log-probs, losses, gradients), not how fast or with how much memory."""
    skip = ("timing", "perf/", "memory", "throughput", "time")
    return {k: v for k, v in row.items() if isinstance(v, float | int) and not any(s in k for s in skip)}


def _assert_same(got_rows: list[dict[str, float]], want_rows: list[dict[str, float]]) -> None:
    assert len(got_rows) == len(want_rows)
    for a, b in zip(want_rows, got_rows):
        want, got = _compared(a), _compared(b)
        assert want.keys() == got.keys() and {"critic/score/mean", "actor/grad_norm"} <= want.keys()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (key, got[key], want[key])


def test_cache_run_equals_plain_run_and_reuses(tmp_path: Path) -> None:
    model = build_tiny_vl_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = _video_data(tmp_path / "data")
    steps = 2 * VIDEOS // 2  # two epochs of two prompts a step
    plain, _, _ = run(tmp_path / "plain", model, {"train": data["train"]}, _edits(data), steps=steps)
    cache = tmp_path / "cache"
    edits = _edits(data) | {"data.cache_dir": str(cache)}
    cached, _, _ = run(tmp_path / "cached", model, {"train": data["train"]}, edits, steps=steps)
    _assert_same(cached, plain)
    # Epoch 1: each rank encodes the videos of its rows once (the rollout's n samples and the second pass reuse
    # them); epoch 2 encodes nothing. The driver logs the ranks' mean.
    for rows in (plain, cached):
        assert all(r["perf/vision_items_encoded"] > 0 for r in rows[: steps // 2])
        assert all(r["perf/vision_items_encoded"] == 0 for r in rows[steps // 2 :])
        assert all(r["perf/vision_items_reused"] > 0 for r in rows)
    assert len(list(cache.glob("*/*.safetensors"))) == VIDEOS
    # The rollout engine: epoch 1's videos were not encoded before its generate (pixels), epoch 2's are held by the
    # actor's memo (the engine takes its outputs and runs no tower: easyrl.rollout.media_embeds)
    for rows in (plain, cached):
        assert all(r["perf/rollout_items_as_pixels"] > 0 for r in rows[: steps // 2])
        assert all(r["perf/rollout_items_as_embeds"] == 0 for r in rows[: steps // 2])
        assert all(r["perf/rollout_items_as_embeds"] > 0 for r in rows[steps // 2 :])
        assert all(r["perf/rollout_items_as_pixels"] == 0 for r in rows[steps // 2 :])
    # A fresh run (new workers, empty memory) on the filled cache: every encoding comes from disk
    again, _, _ = run(tmp_path / "again", model, {"train": data["train"]}, edits, steps=steps)
    assert all(r["perf/vision_items_encoded"] == 0 for r in again)
    assert all(r["perf/rollout_items_as_embeds"] > 0 and r["perf/rollout_items_as_pixels"] == 0 for r in again)
    _assert_same(again, plain)
