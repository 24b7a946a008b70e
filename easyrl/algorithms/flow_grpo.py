"""Flow-GRPO's math as pure tensor functions: the SDE step of a flow-matching sampler and its log-probability,
classifier-free guidance, the closed-form KL between two such steps, and timestep subsampling (docs/diffusion.md).

Public names (stable; the diffusion engine, policy and actor import them): `sde_step`, `guided_velocity`,
`gaussian_kl`, `train_steps_mask`, `num_train_steps`.

A flow-matching (rectified-flow) model interpolates ``x_sigma = (1 - sigma) * x0 + sigma * eps`` and predicts the
velocity ``v = eps - x0``; its ODE sampler steps ``x <- x + v * (sigma_next - sigma)`` from sigma = 1 (noise) to
0 (image). That step is deterministic and has no log-probability, so Flow-GRPO samples instead from the SDE with the
same marginals, whose Euler-Maruyama step is a Gaussian with

    s    = a * sqrt(sigma / (1 - sigma))                     (a = noise_level; at sigma = 1 see `sde_step`)
    dt   = sigma_next - sigma                                (< 0)
    mean = x * (1 + s^2 / (2 sigma) * dt) + v * (1 + s^2 (1 - sigma) / (2 sigma)) * dt
    std  = s * sqrt(-dt)

Each transition x_sigma -> x_sigma_next is then one "token" of the trajectory: the clipped ratio, GRPO's group
advantages and the token-mean aggregation of the LLM losses apply over the T steps unchanged.

Where we depart from Flow-GRPO's reference code: `sde_step` returns the transition's standard deviation
(``s * sqrt(-dt)``), and `gaussian_kl` divides by its square, which is the exact KL between the two Gaussian steps;
Flow-GRPO's loss divides by ``s^2`` alone (its KL is that one scaled by ``1 / -dt``).
"""

from __future__ import annotations

import math

import torch


__all__ = ["gaussian_kl", "guided_velocity", "num_train_steps", "sde_step", "train_steps_mask"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (B,) sigma as a float32 tensor that broadcasts against ``like`` (B, ...): shape (B, 1, ..., 1)."""
    out = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if out.ndim == 0:
        return out.reshape([1] * like.ndim)
    return out.reshape(out.shape[0], *([1] * (like.ndim - 1)))


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE transition of a flow-matching sampler from ``sigma`` to ``sigma_next < sigma``, with its log-prob.

    Args:
        velocity: (B, ...) the (guided) model output at ``sample``.
        sample: (B, ...) the current latents x_sigma.
        sigma: scalar or (B,) current noise level in (0, 1].
        sigma_next: scalar or (B,) next noise level in [0, sigma).
        noise_level: Flow-GRPO's ``a`` (> 0): the SDE's noise scale.
        noise: (B, ...) standard-normal noise to step with (sampling with a fixed draw); default: drawn.
        prev_sample: (B, ...) an already taken step to score instead of sampling one (the update's use).
        generator: the generator the noise is drawn from when neither ``noise`` nor ``prev_sample`` is given.

    Returns:
        ``(prev_sample, log_prob, mean, std)``: prev_sample (B, ...) float32 x_sigma_next; log_prob (B,) the Gaussian
        log-density of prev_sample averaged over every element of one sample; mean (B, ...) the step's mean, which
        carries the gradient to ``velocity``; std (B, 1, ..., 1) or (1, ..., 1) the step's standard deviation.

    The log-density is a mean over the C*H*W (*F) elements, not a sum, as in Flow-GRPO: a sum grows with the
    resolution (thousands of elements), so a small change of the weights would move exp(new - old) far outside
    any clip range; the per-element mean keeps the ratio on the scale PPO's clip of 0.2 expects at every size.

    At sigma = 1, ``sigma / (1 - sigma)`` is infinite; like Flow-GRPO (which uses the schedule's second sigma there),
    the denominator then takes ``1 - sigma_next``, the same number for a schedule's first step.
    """
    if noise_level <= 0:
        raise ValueError(
            f"noise_level={noise_level} leaves the SDE step deterministic with no log-probability; "
            "set worker.rollout.diffusion.noise_level > 0 (Flow-GRPO uses 0.7)"
        )
    # bf16 loses the small differences the ratio is made of (and can overflow in the mean): compute in float32.
    velocity, sample = velocity.float(), sample.float()
    sig, sig_next = _per_sample(sigma, sample), _per_sample(sigma_next, sample)
    dt = sig_next - sig
    s = noise_level * torch.sqrt(sig / (1.0 - torch.where(sig >= 1.0, sig_next, sig)))
    mean = (
        sample * (1.0 + s.square() / (2.0 * sig) * dt) + velocity * (1.0 + s.square() * (1.0 - sig) / (2.0 * sig)) * dt
    )
    std = s * torch.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(sample.shape, generator=generator, device=sample.device, dtype=torch.float32)
        prev_sample = mean.detach() + std * noise.float()
    else:
        prev_sample = prev_sample.float()
    # Gaussian log-density of the taken step; prev_sample is data here, the gradient flows through mean alone.
    log_density = -(prev_sample.detach() - mean).square() / (2.0 * std.square()) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    return prev_sample, log_prob, mean, std


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``uncond + w * (cond - uncond)``; (B, ...) -> (B, ...). w = 1 returns ``cond``."""
    return uncond + guidance_scale * (cond - uncond)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) of one transition, averaged over each sample's elements.

    Both policies step from the same x_sigma with the same std (it depends on the schedule alone), so the KL is
    ``(mean - ref_mean)^2 / (2 std^2)`` per element; it is averaged like `sde_step`'s log-prob so the two terms of
    the loss share one scale.

    Args:
        mean: (B, ...) the policy's step mean (with gradient).
        ref_mean: (B, ...) the reference's step mean.
        std: (B, 1, ..., 1) or broadcastable: the step's standard deviation from `sde_step`.

    Returns:
        (B,) the per-transition KL.
    """
    kl = (mean.float() - ref_mean.float()).square() / (2.0 * std.float().square())
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def num_train_steps(num_steps: int, fraction: float) -> int:
    """How many of a trajectory's ``num_steps`` steps train: floor(fraction * num_steps), at least one."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"train_timestep_fraction={fraction} is outside (0, 1]; "
            "set worker.rollout.diffusion.train_timestep_fraction to e.g. 0.6, or 1.0 to train every step"
        )
    # The epsilon keeps 0.7 * 10 = 7.000000000000001 and 0.29 * 100 = 28.999999999999996 on the intended count.
    return max(1, math.floor(fraction * num_steps + 1e-6))


def train_steps_mask(num_samples: int, num_steps: int, fraction: float, seed: int) -> torch.Tensor:
    """Which denoising steps each trajectory trains on: (B, T) float 0/1 with exactly `num_train_steps` ones per row.

    The steps are a uniform random subset drawn independently per row from a generator seeded with ``seed`` (the
    same seed gives the same mask on every rank and on resume); Flow-GRPO trains on such a subset to cut the
    update's cost with little loss of signal.
    """
    k = num_train_steps(num_steps, fraction)
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(num_samples, num_steps, generator=gen).argsort(dim=1)
    mask = torch.zeros(num_samples, num_steps)
    mask.scatter_(1, order[:, :k], 1.0)
    return mask
