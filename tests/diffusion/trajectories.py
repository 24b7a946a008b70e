"""A small SDE sampling loop over a denoiser, recording what the diffusion engine records, for the policy and actor
tests (the engine itself is `easyrl.diffusion.engine`'s; this loop is independent of it on purpose: the log-probs
the policy recomputes must match ones recorded by plain `sde_step` calls)."""

from __future__ import annotations

import torch
from torch import nn

from easyrl.algorithms.flow_grpo import sde_step, train_steps_mask
from easyrl.diffusion.policy import LATENTS, SIGMAS, TIMESTEPS, denoiser_velocity


def text_features(transformer: nn.Module, rows: int, seed: int, length: int = 6) -> dict[str, torch.Tensor]:
    """Random prompt features of the transformer's widths, conditional and unconditional."""
    gen = torch.Generator().manual_seed(seed)
    joint, pooled = transformer.config.joint_attention_dim, transformer.config.pooled_projection_dim
    return {
        "prompt_embeds": torch.randn(rows, length, joint, generator=gen),
        "pooled_prompt_embeds": torch.randn(rows, pooled, generator=gen),
        "negative_prompt_embeds": torch.randn(rows, length, joint, generator=gen),
        "negative_pooled_prompt_embeds": torch.randn(rows, pooled, generator=gen),
    }


@torch.no_grad()
def sample_trajectories(
    transformer: nn.Module,
    text: dict[str, torch.Tensor],
    *,
    num_steps: int,
    guidance_scale: float,
    noise_level: float,
    seed: int,
    fraction: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Sample B trajectories of `num_steps` SDE steps from a shifted flow-matching schedule; the batch fields."""
    rows = text["prompt_embeds"].shape[0]
    size, channels = transformer.config.sample_size, transformer.config.in_channels
    gen = torch.Generator().manual_seed(seed)
    plain = torch.linspace(1.0, 0.0, num_steps + 1)
    sigmas = 3.0 * plain / (1.0 + 2.0 * plain)  # SD3's shift of 3: more steps at high noise
    x = torch.randn(rows, channels, size, size, generator=gen)
    latents, log_probs = [x], []
    for t in range(num_steps):
        sig = sigmas[t].expand(rows)
        velocity = denoiser_velocity(transformer, x, sig * 1000.0, text, guidance_scale)
        x, lp, _, _ = sde_step(velocity, x, sigmas[t], sigmas[t + 1], noise_level, generator=gen)
        latents.append(x)
        log_probs.append(lp)
    mask = train_steps_mask(rows, num_steps, fraction, seed)
    return {
        LATENTS: torch.stack(latents, dim=1),
        SIGMAS: sigmas.expand(rows, -1).clone(),
        TIMESTEPS: (sigmas * 1000.0).expand(rows, -1).clone(),
        **text,
        "rollout_log_probs": torch.stack(log_probs, dim=1),
        "response_mask": mask,
        "loss_mask": mask.clone(),
    }
