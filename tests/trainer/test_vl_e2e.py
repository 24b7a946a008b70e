"""Vision-language RL end to end on CPU: tiny random Qwen2.5-VL and Qwen3-VL, generated images, 2 FSDP2
workers, the HF engine. The vision tower can only change if the pixels really reached the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from tests.trainer.test_e2e import assert_finite, run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


def _image_data(folder: Path) -> dict[str, str]:
    """16 rows, each with one generated image of its own colour and size, referenced by a relative path."""
    images = folder / "images"
    images.mkdir(parents=True)
    rows = []
    for i in range(16):
        name = f"img{i}.png"
        Image.new("RGB", (32 + 16 * (i % 3), 32 + 16 * (i % 2)), (15 * i, 255 - 15 * i, 60)).save(images / name)
        rows.append(
            {"prompt": f"<image>How many digits are in {i}{i}?", "answer": str(len(f"{i}{i}")), "images": [name]}
        )
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": str(train), "image_dir": str(images)}


def vl_edits(data: dict[str, str]) -> dict[str, object]:
    """Config edits for :func:`_image_data`: its image folder, small images, prompts long enough for them."""
    return {
        "data.image_dir": data["image_dir"],
        "data.max_prompt_length": 160,
        "data.min_pixels": 32 * 32,
        "data.max_pixels": 64 * 64,
    }


def _assert_the_pixels_trained_the_tower(rows: list[dict[str, float]], before: Any, after: Any) -> None:
    """The actor's vision tower moved (it can only get a gradient from pixels that reached the model), and the image
    tokens were expanded into the prompt."""
    assert_finite(rows)
    assert before is not None and after is not None
    vision = [n for n in before if ".visual." in f".{n}" or n.startswith(("visual.", "model.visual."))]
    assert vision, f"no vision-tower parameters found in {list(before)[:5]}"
    assert any(not torch.equal(before[n], after[n]) for n in vision), "the vision tower got no gradient: no pixels?"
    assert rows[0]["prompt_length/mean"] > 40  # image tokens expanded into the prompt


@pytest.mark.extended  # make test: test_vl_ppo_with_critic (below) makes the same checks on its own run
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_grpo_two_steps(tmp_path: Path, digits_data, arch: str) -> None:
    """The actor's VL path under GRPO. Its checks run in `make test` on `test_vl_ppo_with_critic`'s run, whose actor
    update is the same code (the estimator differs; GRPO's own path is the golden run, tests/trainer/test_e2e.py)."""
    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch)
    data = _image_data(tmp_path / "data")
    edits = vl_edits(data)
    rows, before, after = run(tmp_path / "run", model, {"train": data["train"]}, edits, steps=2, weights=True)
    _assert_the_pixels_trained_the_tower(rows, before, after)


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_ppo_with_critic(tmp_path: Path, arch: str) -> None:
    """GAE with a VL critic (the checkpoint's backbone plus a value head): values and the critic update see the
    same images as the actor; and the actor's own vision tower trains from the pixels (`test_vl_grpo_two_steps`'s
    checks, on this run: one run shows both)."""
    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch)
    data = _image_data(tmp_path / "data")
    edits = vl_edits(data) | {
        "algorithm.adv_estimator": "gae",
        "worker.critic.global_batch_size": 2,
        "worker.critic.micro_batch_size_per_device_for_update": 2,
    }
    rows, before, after = run(tmp_path / "run", model, {"train": data["train"]}, edits, steps=2, weights=True)
    _assert_the_pixels_trained_the_tower(rows, before, after)
    for row in rows:
        assert row["critic/vf_loss"] > 0
    assert rows[0]["critic/vpred_mean"] != rows[1]["critic/vpred_mean"]  # the critic trained between the steps


def test_bench_vl_script_tiny_video_runs(tmp_path: Path) -> None:
    """`scripts/bench_vl.py --tiny --media video` trains through Ray on CPU and writes its per-step summary."""
    from tests.conftest import run_script_in_process

    run_script_in_process("bench_vl.py", "--tiny", "--media", "video", "--steps", "1", workdir=tmp_path)
    summary = json.loads(next(tmp_path.glob("run_tiny_video_*/summary.json")).read_text())
    assert len(summary["steps"]) == 2 and all(s["timing_s/step"] > 0 for s in summary["steps"])


def test_bench_vl_model_has_the_public_3b_shape() -> None:
    """The benchmark's Qwen2.5-VL-3B has the published checkpoint's 3.75B parameters (counted on the meta device)."""
    import importlib.util

    from easyrl.testing.tiny_vl import make_vl_config, make_vl_tokenizer

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_vl", repo / "scripts" / "bench_vl.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = bench.QWEN25_VL_3B
    config = make_vl_config(
        make_vl_tokenizer(),
        "qwen2_5_vl",
        patch_size=14,
        **shape["text"],
        **shape["vision"],
        text_overrides=shape["text_overrides"],
        vision_overrides=shape["vision_overrides"],
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 3_754_622_976


def _video_data(folder: Path) -> dict[str, str]:
    """16 rows sharing one generated clip (a sweeping bar, 4 sampled frames), each with its own question."""
    from tests.workers.test_packing_vl import _write_video

    folder.mkdir(parents=True)
    _write_video(folder / "clip.mp4")
    rows = [{"prompt": f"<video>How many digits are in {i}{i}?", "answer": str(len(f"{i}{i}")), "videos": ["clip.mp4"]}
            for i in range(16)]  # fmt: skip
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": str(train), "video_dir": str(folder)}


@pytest.mark.parametrize(("arch", "media"), [*((arch, "image") for arch in VL_ARCHS), ("qwen2_5_vl", "video")])
def test_vl_grpo_with_one_step_of_staleness(tmp_path: Path, arch: str, media: str) -> None:
    """Carry-over (`trainer.max_staleness: 1`) on image or video prompts: responses cut at a step's end resume in
    the next with their media (chunks of 2 tokens, variable lengths), no trained token is older than one update, and
    the policy learns from the pixels: the vision tower changes, as in the synchronous run above."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer
    from tests.conftest import apply_edits, base_config, write_config
    from tests.rollout.test_carry_over import ASYNC_EDITS

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch)
    if media == "image":
        data = _image_data(tmp_path / "data")
        edits = vl_edits(data)
    else:
        data = _video_data(tmp_path / "data")
        edits = {"data.video_dir": data["video_dir"], "data.max_prompt_length": 160, "data.max_pixels": 64 * 64}
    edits |= ASYNC_EDITS | {"trainer.max_staleness": 1, "trainer.max_steps": 4}
    conf = apply_edits(base_config(model, {"train": data["train"]}, tmp_path / "run"), edits)
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    trained: list[tuple[int, Any]] = []
    update = trainer.actor.update_actor

    def record_update(batch: Any, entropy_coeff: float) -> dict[str, float]:  # the real update, its batch kept
        trained.append((trainer.actor.policy_version(), batch))
        return update(batch, entropy_coeff)

    trainer.actor.update_actor = record_update
    try:
        before = trainer.actor.full_weights()
        trainer.fit()
        after = trainer.actor.full_weights()
    finally:
        trainer.close()
    assert len(trained) == 4
    for version, batch in trained:
        assert all(media is not None for media in batch["multi_modal_inputs"])  # every row kept its image
        ages = (version - batch["token_policy_version"])[batch["loss_mask"].bool()]
        assert int(ages.min()) >= 0 and int(ages.max()) <= 1, ages
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    assert_finite(rows)
    assert max(r["async/resumed_fraction"] for r in rows) > 0  # some responses resumed with newer weights
    assert max(r["async/version_span_max"] for r in rows) == 1.0
    vision = [n for n in before if ".visual." in f".{n}" or n.startswith(("visual.", "model.visual."))]
    assert vision and any(not torch.equal(before[n], after[n]) for n in vision), "the vision tower did not learn"


def test_a_resumed_vl_run_with_images_in_flight_is_the_uninterrupted_one(tmp_path: Path) -> None:
    """Carry-over (S = 1) on image prompts, resumed from the step-2 checkpoint: the checkpoint holds partial responses
    with their images (base64, `trajectory.columns_state`), and the resumed run's steps 3 and 4 are the uninterrupted
    run's to the bit (the same pixels and grids reach the engine and the update). The checkpoint is the uninterrupted
    run's own, as a run killed after step 2 leaves it; the resumed run starts in a fresh folder."""
    from tests.conftest import train_steps
    from tests.rollout.test_carry_over import ASYNC_EDITS, _stable

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl")
    data = _image_data(tmp_path / "data")
    edits = vl_edits(data) | ASYNC_EDITS | {"trainer.max_staleness": 1, "trainer.save_freq": 2}
    full, _, _ = train_steps(tmp_path / "full", model, {"train": data["train"]}, edits, steps=4)
    checkpoint = tmp_path / "full" / "run" / "global_step_2"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    groups = saved["state"]["rollout_loop"]["groups"]
    partial = [g for g in groups if any(s["response_ids"] and not s["done"] for s in g["samples"])]
    assert partial and all("__tensor__" in str(g["columns"]["multi_modal_inputs"]) for g in partial)
    edits["trainer.load_checkpoint_path"] = str(checkpoint)
    resumed, _, _ = train_steps(tmp_path / "resumed", model, {"train": data["train"]}, edits, steps=4)
    assert [r["step"] for r in resumed] == [3, 4]
    assert _stable(resumed) == _stable(full[2:]), "the resumed VL run left the uninterrupted curve"
    assert max(r["async/resumed_fraction"] for r in resumed) > 0
