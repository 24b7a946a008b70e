"""`easyrl.diffusion.policy`: the denoiser's transition log-probs under the weights that sampled equal the ones
recorded while sampling, with and without guidance, on the trained steps only; the KL of a policy to itself is 0."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel

from easyrl.diffusion.policy import denoiser_velocity, trained_step_order, transition_kl, transition_log_probs
from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from tests.diffusion.trajectories import sample_trajectories, text_features


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> SD3Transformer2DModel:
    path = build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0)
    return SD3Transformer2DModel.from_pretrained(path, subfolder="transformer").eval()


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_recomputed_log_probs_match_the_sampled_ones(transformer: SD3Transformer2DModel, guidance: float) -> None:
    batch = sample_trajectories(
        transformer, text_features(transformer, 3, seed=1), num_steps=4, guidance_scale=guidance, noise_level=0.7,
        seed=2, fraction=0.5,
    )  # fmt: skip
    mask = batch["response_mask"]
    with torch.no_grad():
        scores = transition_log_probs(transformer, batch, guidance, 0.7, mask)
    recorded = batch["rollout_log_probs"]
    assert torch.allclose(scores.log_probs[mask > 0], recorded[mask > 0], atol=1e-5)
    assert torch.equal(scores.log_probs[mask == 0], torch.zeros(int((mask == 0).sum())))
    # All steps: every recorded log-prob, and a KL of 0 to the same weights.
    with torch.no_grad():
        full = transition_log_probs(transformer, batch, guidance, 0.7)
    assert torch.allclose(full.log_probs, recorded, atol=1e-5)
    assert torch.allclose(transition_kl(full.means, full.means.clone(), full.stds), torch.zeros(3, 4))


def test_other_weights_score_the_trajectory_lower_and_the_kl_grows(transformer: SD3Transformer2DModel) -> None:
    batch = sample_trajectories(
        transformer, text_features(transformer, 2, seed=3), num_steps=3, guidance_scale=1.0, noise_level=0.7, seed=4
    )
    other = SD3Transformer2DModel.from_config(transformer.config)
    other.load_state_dict(transformer.state_dict())
    with torch.no_grad():
        for p in other.proj_out.parameters():
            p.add_(2.0)
        mine, theirs = (transition_log_probs(m, batch, 1.0, 0.7) for m in (transformer, other))
    assert (theirs.log_probs < mine.log_probs).all()
    assert torch.equal(mine.stds, theirs.stds)  # the schedule's alone
    assert (transition_kl(theirs.means, mine.means, mine.stds) > 0).all()


def test_log_probs_carry_the_gradient_to_the_weights(transformer: SD3Transformer2DModel) -> None:
    batch = sample_trajectories(
        transformer, text_features(transformer, 2, seed=5), num_steps=2, guidance_scale=2.0, noise_level=0.7, seed=6
    )
    scores = transition_log_probs(transformer, batch, 2.0, 0.7)
    scores.log_probs.sum().backward()
    grads = [p.grad for p in transformer.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    transformer.zero_grad(set_to_none=True)


def test_trained_step_order_fills_short_rows_with_untrained_steps() -> None:
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    steps, valid = trained_step_order(mask)
    assert steps.tolist()[0] == [1, 3] and steps.tolist()[1][0] == 0 and mask[1, steps[1, 1]] == 0
    assert valid.tolist() == [[True, True], [True, False]]


def test_guidance_without_negative_features_is_refused(transformer: SD3Transformer2DModel) -> None:
    text = text_features(transformer, 1, seed=7)
    del text["negative_prompt_embeds"]
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        denoiser_velocity(transformer, torch.zeros(1, 4, 8, 8), torch.tensor([500.0]), text, 3.0)
