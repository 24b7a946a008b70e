"""`easyrl.diffusion.engine`: the diffusers rollout engine samples the tiny SD3 pipeline with SDE steps, records each
trajectory, and draws a row's noise from the row's own seed (the same images whatever the batch split)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from easyrl.batch import Batch
from easyrl.config.diffusion import DiffusionConfig
from easyrl.diffusion.engine import DiffusionRolloutEngine
from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from easyrl.rollout.engine import SamplingParams
from easyrl.seeding import SEED_COLUMN


@pytest.fixture(scope="module")
def pipeline_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0)


def make_engine(path: str, **changes: object) -> DiffusionRolloutEngine:
    config = DiffusionConfig(num_steps=3, height=32, width=32, max_sequence_length=8, **changes)  # type: ignore[arg-type]
    return DiffusionRolloutEngine(path, torch.device("cpu"), torch.float32, config)


def prompts(texts: list[str], seeds: list[int]) -> Batch:
    return Batch({SEED_COLUMN: torch.tensor(seeds)}, {"raw_prompt": texts})


def test_a_call_records_the_trajectory_of_every_sample(pipeline_path: str) -> None:
    engine = make_engine(pipeline_path, train_timestep_fraction=2 / 3)
    out = engine.generate(prompts(["a red square", "blue"], [5, 9]), SamplingParams(n=2))
    assert out["latents"].shape == (4, 4, 4, 8, 8)  # N = 2 prompts x 2, T+1 = 4 states, 4 x 8 x 8 latents
    assert out["sigmas"].shape == out["timesteps"].shape == (4, 4)
    assert out["sigmas"][0, 0] == 1.0 and out["sigmas"][0, -1] == 0.0
    assert out["response_mask"].shape == out["rollout_log_probs"].shape == (4, 3)
    assert out["response_mask"].sum(dim=1).tolist() == [2.0] * 4  # 2 of 3 steps per trajectory
    assert torch.equal(out["loss_mask"], out["response_mask"])
    assert torch.isfinite(out["rollout_log_probs"]).all() and (out["rollout_log_probs"] != 0).all()
    # guidance on (4.5): the unconditional branch's features travel with the rows
    assert out["negative_prompt_embeds"].shape == out["prompt_embeds"].shape
    # the samples of a group share their prompt's features and differ in their noise
    assert torch.equal(out["prompt_embeds"][0], out["prompt_embeds"][1])
    assert not torch.equal(out["prompt_embeds"][1], out["prompt_embeds"][2])
    assert not torch.equal(out["latents"][0, 0], out["latents"][1, 0])
    images = out["images"]
    assert len(images) == 4 and all(isinstance(a, np.ndarray) for a in images)
    assert images[0].shape == (32, 32, 3) and images[0].dtype == np.uint8


def test_the_same_seed_gives_the_same_images_whatever_the_batch_split(pipeline_path: str) -> None:
    engine = make_engine(pipeline_path)
    texts, seeds = ["a red square", "a green circle", "blue"], [11, 40, 7]
    whole = engine.generate(prompts(texts, seeds), SamplingParams(n=2))
    first = engine.generate(prompts(texts[:1], seeds[:1]), SamplingParams(n=2))
    rest = engine.generate(prompts(texts[1:], seeds[1:]), SamplingParams(n=2))
    for key in ("latents", "rollout_log_probs", "response_mask"):
        torch.testing.assert_close(whole[key], torch.cat([first[key], rest[key]]), rtol=1e-5, atol=1e-5)
    again = engine.generate(prompts(texts, [s + 1 for s in seeds]), SamplingParams(n=2))
    assert not torch.equal(whole["latents"], again["latents"])


def test_without_guidance_one_forward_per_step_and_no_negative_features(pipeline_path: str) -> None:
    engine = make_engine(pipeline_path, guidance_scale=1.0)
    out = engine.generate(prompts(["red"], [3]), SamplingParams(n=2))
    assert "negative_prompt_embeds" not in out and out["latents"].shape[0] == 2


def test_loaded_weights_change_the_samples_and_unknown_names_are_refused(pipeline_path: str) -> None:
    engine = make_engine(pipeline_path)
    before = engine.generate(prompts(["red"], [3]), SamplingParams(n=1))["latents"]
    weights = [(name, torch.zeros_like(p)) for name, p in engine.pipeline.transformer.named_parameters()]
    engine.load_weights(weights)
    after = engine.generate(prompts(["red"], [3]), SamplingParams(n=1))["latents"]
    assert torch.equal(before[:, 0], after[:, 0]) and not torch.equal(before[:, -1], after[:, -1])
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))])


def test_a_pipeline_folder_without_a_transformer_denoiser_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        make_engine(str(tmp_path))  # no model_index.json: diffusers' own error names the folder


def test_the_rollout_log_probs_are_what_the_update_scores_for_the_recorded_steps(pipeline_path: str) -> None:
    from easyrl.diffusion.policy import transition_log_probs

    engine = make_engine(pipeline_path, train_timestep_fraction=2 / 3)
    out = engine.generate(prompts(["a red square", "blue"], [5, 9]), SamplingParams(n=2))
    cfg = engine.config
    with torch.no_grad():
        scores = transition_log_probs(
            engine.pipeline.transformer, out.tensors, cfg.guidance_scale, cfg.noise_level, out["response_mask"]
        )
    trained = out["response_mask"].bool()
    torch.testing.assert_close(scores.log_probs[trained], out["rollout_log_probs"][trained], rtol=1e-5, atol=1e-5)


def test_the_reward_gets_each_rows_image_and_columns(pipeline_path: str) -> None:
    from easyrl.rewards import load_reward_function
    from easyrl.trainer.reward_inputs import image_reward_inputs, reward_inputs_for
    from tests.conftest import REPO

    assert reward_inputs_for("diffusion", None, True) is image_reward_inputs
    out = make_engine(pipeline_path).generate(prompts(["a red image", "a blue image"], [1, 2]), SamplingParams(n=2))
    out.set(row=[{"id": i // 2} for i in range(4)], raw_prompt=["a red image"] * 2 + ["a blue image"] * 2)
    out.set(ground_truth=["red", "red", "blue", "blue"])
    inputs, texts = image_reward_inputs(out)
    assert [i["id"] for i in inputs] == [0, 0, 1, 1] and texts == [""] * 4
    assert inputs[2]["image"] is out["images"][2] and inputs[2]["prompt"] == "a blue image"
    scores = load_reward_function(str(REPO / "reward_functions" / "colour.py")).fn(inputs)
    assert all(0.0 <= s["overall"] <= 1.0 for s in scores) and len({s["overall"] for s in scores}) == 4


def test_a_call_denoises_with_the_steps_it_asks_for(pipeline_path: str) -> None:
    """`SamplingParams.denoising_steps` (validation's `val_num_steps`) wins over the config's `num_steps` (3): as many
    denoiser forwards (guidance off: one per step) and states as asked; None keeps `num_steps`."""
    engine = make_engine(pipeline_path, guidance_scale=1.0)
    calls: list[int] = []
    hook = engine.pipeline.transformer.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        short = engine.generate(prompts(["a red square"], [5]), SamplingParams(n=2, denoising_steps=2))
        forwards_short, calls[:] = len(calls), []
        default = engine.generate(prompts(["a red square"], [5]), SamplingParams(n=2))
    finally:
        hook.remove()
    assert forwards_short == 2 and short["latents"].shape[1] == 3 and short["rollout_log_probs"].shape == (2, 2)
    assert len(calls) == 3 and default["latents"].shape[1] == 4
    assert torch.equal(short["latents"][:, 0], default["latents"][:, 0])  # the same seed: the same starting noise
