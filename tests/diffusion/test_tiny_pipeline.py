"""`easyrl.diffusion.tiny`: the tiny SD3 pipeline folder loads with diffusers' own loader and samples images."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from easyrl.diffusion.tiny import build_tiny_sd3_pipeline, make_clip_tokenizer


def test_the_folder_loads_with_a_plain_from_pretrained_and_samples_images(tmp_path: Path) -> None:
    path = build_tiny_sd3_pipeline(tmp_path / "sd3", seed=3)
    index = json.loads((tmp_path / "sd3" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    pipe = DiffusionPipeline.from_pretrained(path)
    assert pipe.text_encoder_3 is not None and pipe.vae_scale_factor == 4

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        out = pipe(
            ["a red square"], num_inference_steps=2, max_sequence_length=8, output_type="pt", generator=generator
        )
        return out.images

    images = sample(0)
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()
    assert torch.equal(images, sample(0)) and not torch.equal(images, sample(1))


def test_the_same_seed_builds_the_same_weights(tmp_path: Path) -> None:
    first = DiffusionPipeline.from_pretrained(build_tiny_sd3_pipeline(tmp_path / "a", seed=1)).transformer
    second = DiffusionPipeline.from_pretrained(build_tiny_sd3_pipeline(tmp_path / "b", seed=1)).transformer
    third = DiffusionPipeline.from_pretrained(build_tiny_sd3_pipeline(tmp_path / "c", seed=2)).transformer
    pairs = list(zip(first.state_dict().values(), second.state_dict().values(), third.state_dict().values()))
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)


def test_the_clip_tokenizer_spells_any_ascii_prompt_without_unknowns() -> None:
    tokenizer = make_clip_tokenizer(max_length=32)
    ids = tokenizer("Paint it RED, 3 times!").input_ids
    assert tokenizer.unk_token_id not in ids[1:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == "paintitred,3times!"


def test_the_colour_decoder_reads_latent_channels_as_red_green_and_blue(tmp_path: Path) -> None:
    plain = DiffusionPipeline.from_pretrained(build_tiny_sd3_pipeline(tmp_path / "plain", seed=0))
    pipe = DiffusionPipeline.from_pretrained(build_tiny_sd3_pipeline(tmp_path / "colour", seed=0, colour_decoder=True))
    # only the decoder differs: the denoiser the demo trains is the plain build's
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain.transformer.state_dict().values(), pipe.transformer.state_dict().values())
    )
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))

    def mean_rgb(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1).mean(dim=(0, 2, 3))

    for channel in range(3):
        latents = noise.clone()
        latents[:, channel] = latents[:, channel].abs() + 1.0  # positive everywhere: that colour dominates
        rgb = mean_rgb(pipe.vae, latents)
        others = [c for c in range(3) if c != channel]
        assert rgb[channel] > 0.85 and all(abs(rgb[c] - 0.5) < 0.15 for c in others), (channel, rgb.tolist())
        # the random decoder barely responds to the same change (why the demo ships the colour decoder)
        moved = (mean_rgb(plain.vae, latents) - mean_rgb(plain.vae, noise)).abs().max()
        assert moved < 0.1, (channel, float(moved))
