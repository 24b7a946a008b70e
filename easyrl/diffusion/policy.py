"""The denoiser as a policy: its guided forward and the log-probability of each recorded denoising transition.

Public names (stable; the engine, the actor and the trainer wiring import them): `LATENTS`, `SIGMAS`, `TIMESTEPS`,
`TEXT_FIELDS`, `NEGATIVE_FIELDS`, `TransitionScores`, `denoiser_velocity`, `trained_step_order`,
`transition_log_probs`, `transition_kl`.

A sampled trajectory is recorded as ``latents`` (B, T+1, C, H, W: x at sigma_0 = 1 down to x at sigma_T = 0; or
(B, T+1, C, F, H, W) for video), ``sigmas`` (B, T+1) and ``timesteps`` (B, T+1: what the transformer is called with,
sigma * the scheduler's num_train_timesteps), plus the prompt's text features. Transition t goes from
``latents[:, t]`` to ``latents[:, t + 1]``; its log-probability under the current weights is `sde_step`'s with
``prev_sample = latents[:, t + 1]``.

Only the steps a trajectory trains on are run (`response_mask`, from `train_steps_mask`): row b's k-th trained step
is batched with every other row's k-th, whatever its index (the transformer takes one timestep per row), so a
micro-batch costs k forwards, not T. Untrained steps score 0 and are masked out of every loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from easyrl.algorithms.flow_grpo import gaussian_kl, guided_velocity, sde_step


__all__ = [
    "LATENTS",
    "NEGATIVE_FIELDS",
    "SIGMAS",
    "TEXT_FIELDS",
    "TIMESTEPS",
    "TransitionScores",
    "denoiser_velocity",
    "trained_step_order",
    "transition_kl",
    "transition_log_probs",
]

LATENTS, SIGMAS, TIMESTEPS = "latents", "sigmas", "timesteps"
TEXT_FIELDS = ("prompt_embeds", "pooled_prompt_embeds")
"""The prompt's features: the transformer's ``encoder_hidden_states`` and (SD3) ``pooled_projections``; a
transformer without pooled projections (Wan) has no ``pooled_prompt_embeds`` row field."""
NEGATIVE_FIELDS = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")
"""The unconditional branch's features under classifier-free guidance, in `TEXT_FIELDS`' order."""


def _text_kwargs(embeds: torch.Tensor, pooled: torch.Tensor | None) -> dict[str, torch.Tensor]:
    kwargs = {"encoder_hidden_states": embeds}
    if pooled is not None:
        kwargs["pooled_projections"] = pooled
    return kwargs


def denoiser_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: Mapping[str, torch.Tensor],
    guidance_scale: float,
) -> torch.Tensor:
    """The (guided) velocity at ``latents`` (B, C, H, W) and ``timestep`` (B,): one forward of the transformer.

    ``text`` holds `TEXT_FIELDS` (B, ...) and, when ``guidance_scale > 1``, `NEGATIVE_FIELDS`; the conditional and
    unconditional branches then run as one batch of 2B rows (one forward, so FSDP gathers each layer once), and the
    velocity is `guided_velocity` of the two. Gradients flow through both branches: the guided velocity is the
    policy's mean, so both move it (Flow-GRPO detaches the unconditional branch; we keep the exact gradient).
    Returns (B, C, H, W) float32.
    """
    embeds, pooled = text[TEXT_FIELDS[0]], text.get(TEXT_FIELDS[1])
    guided = guidance_scale > 1.0
    if guided:
        missing = [k for k in NEGATIVE_FIELDS[: 1 if pooled is None else 2] if k not in text]
        if missing:
            raise ValueError(
                f"guidance_scale={guidance_scale} needs the unconditional branch's features, but the batch has no "
                f"{', '.join(missing)}; the engine records them under guidance (or set "
                "worker.rollout.diffusion.guidance_scale: 1.0)"
            )
        neg_pooled = text[NEGATIVE_FIELDS[1]] if pooled is not None else None
        latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
        embeds = torch.cat([text[NEGATIVE_FIELDS[0]], embeds])
        pooled = torch.cat([neg_pooled, pooled]) if pooled is not None and neg_pooled is not None else None
    dtype = getattr(transformer, "dtype", latents.dtype)
    out = transformer(
        hidden_states=latents.to(dtype),
        timestep=timestep.to(dtype),
        **_text_kwargs(embeds.to(dtype), None if pooled is None else pooled.to(dtype)),
        return_dict=False,
    )[0].float()
    if not guided:
        return out
    uncond, cond = out.chunk(2)
    return guided_velocity(cond, uncond, guidance_scale)


def trained_step_order(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained steps of each row, in order: ``steps`` (B, K) int64 and ``valid`` (B, K) bool, K = the most
    trained steps of any row. Rows with fewer fill ``steps`` with untrained indices (valid False): run, not kept."""
    on = mask > 0
    # A stable sort on "not trained" puts each row's trained steps first, in increasing step order.
    steps = torch.argsort((~on).to(torch.int8), dim=1, stable=True)
    k = int(on.sum(dim=1).max().item()) if on.numel() else 0
    counts = on.sum(dim=1, keepdim=True)
    valid = torch.arange(k, device=mask.device).unsqueeze(0) < counts
    return steps[:, :k], valid


@dataclass
class TransitionScores:
    """Each recorded transition scored under the current weights (0 where a step did not run)."""

    log_probs: torch.Tensor
    """(B, T) float32 `sde_step` log-prob of ``latents[:, t + 1]`` given ``latents[:, t]``."""
    means: torch.Tensor
    """(B, T, C, H, W) float32 the step's mean (the KL's input; carries the gradient)."""
    stds: torch.Tensor
    """(B, T) float32 the step's standard deviation (the schedule's alone: the same for every policy)."""


def transition_log_probs(
    transformer: nn.Module,
    batch: Mapping[str, torch.Tensor],
    guidance_scale: float,
    noise_level: float,
    steps_mask: torch.Tensor | None = None,
    min_forwards: int = 0,
) -> TransitionScores:
    """Score the batch's recorded transitions under ``transformer``'s current weights.

    Args:
        transformer: the denoiser (`SD3Transformer2DModel`, or any diffusers transformer with its call).
        batch: `LATENTS` (B, T+1, ...), `SIGMAS` and `TIMESTEPS` (B, T+1), `TEXT_FIELDS` (and `NEGATIVE_FIELDS`
            under guidance), all on the transformer's device.
        guidance_scale: classifier-free guidance, as sampled.
        noise_level: the SDE's noise scale, as sampled.
        steps_mask: (B, T) the steps to run (``response_mask``); None: all T.
        min_forwards: run at least this many forwards (filler steps, dropped): FSDP ranks must run the same number,
            so a sharded caller passes the most trained steps of any row on any rank.

    Returns:
        `TransitionScores`, with the autograd graph when called with gradients on.
    """
    latents, sigmas, timesteps = batch[LATENTS], batch[SIGMAS], batch[TIMESTEPS]
    b, t = latents.shape[0], latents.shape[1] - 1
    mask = torch.ones(b, t, device=latents.device) if steps_mask is None else steps_mask.to(latents.device)
    text = {k: batch[k] for k in (*TEXT_FIELDS, *NEGATIVE_FIELDS) if k in batch}
    rows = torch.arange(b, device=latents.device)
    log_probs = latents.new_zeros(b, t, dtype=torch.float32)
    means = latents.new_zeros(latents.shape[0], t, *latents.shape[2:], dtype=torch.float32)
    stds = latents.new_zeros(b, t, dtype=torch.float32)
    order, valid = trained_step_order(mask)
    if order.shape[1] < min_forwards:
        # Fillers (min_forwards <= T): any steps, untrained ones first; they run and are never kept.
        fill = torch.argsort((mask > 0).to(torch.int8), dim=1, stable=True)[:, : min_forwards - order.shape[1]]
        order = torch.cat([order, fill], dim=1)
        valid = torch.cat([valid, torch.zeros_like(fill, dtype=torch.bool)], dim=1)
    for k in range(order.shape[1]):
        step = order[:, k]  # (B,) each row's k-th trained step
        velocity = denoiser_velocity(transformer, latents[rows, step], timesteps[rows, step], text, guidance_scale)
        _, lp, mean, std = sde_step(
            velocity,
            latents[rows, step],
            sigmas[rows, step],
            sigmas[rows, step + 1],
            noise_level,
            prev_sample=latents[rows, step + 1],
        )
        keep = valid[:, k]
        at = (rows[keep], step[keep])
        # Out-of-place index_put: the graph reaches every kept row's step, and a filler row's result is dropped.
        log_probs = log_probs.index_put(at, lp[keep])
        means = means.index_put(at, mean[keep])
        stds = stds.index_put(at, std.reshape(-1).expand(b)[keep])
    return TransitionScores(log_probs, means, stds)


def transition_kl(means: torch.Tensor, ref_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """`gaussian_kl` of every transition: means (B, T, ...), stds (B, T) -> (B, T). A step that did not run (std 0)
    scores 0, not NaN (its means are 0 too)."""
    b, t = stds.shape
    flat_std = torch.where(stds > 0, stds, torch.ones_like(stds)).reshape(b * t, *([1] * (means.ndim - 2)))
    kl = gaussian_kl(means.reshape(b * t, *means.shape[2:]), ref_means.reshape(b * t, *means.shape[2:]), flat_std)
    return kl.reshape(b, t)
