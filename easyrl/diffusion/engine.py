"""The diffusion rollout engine (`worker.rollout.name: diffusers`): samples images (or video frames) from a diffusers
flow-matching pipeline with a stochastic (SDE) sampler, so that each denoising step is a Gaussian transition with a
log-probability the update can form a ratio over (docs/diffusion.md).

It plays the part the HF engine plays for LLMs: the pipeline's components load once from
`worker.actor.model.model_path` (`DiffusionPipeline.from_pretrained`); the denoiser (``transformer``) then takes the
policy's weights after every update (`load_weights`), while the text encoders and the VAE stay frozen as loaded.

One call, for B prompts and ``n`` samples each (N = B * n rows, sample ``j`` of prompt ``i`` at row ``i * n + j``):

* each distinct prompt text is encoded once (the ``n`` samples of a group share its features, and so does a prompt
  that appears twice in one batch);
* sample ``j`` of a prompt with seed ``s`` draws its initial noise, its per-step SDE noise and its trained steps
  from its own generator seeded with ``s + j`` (`easyrl.seeding`), so the same seed gives the same images however the
  rows are split over engines;
* the rows carry the trajectory as `latents` (N, T+1, C, h, w: x_T..x_0), `timesteps` and `sigmas` (N, T+1), the
  text features (`prompt_embeds`, `pooled_prompt_embeds`, and their negative twins under guidance), `response_mask`
  and `loss_mask` (N, T: the steps this trajectory trains on, `train_timestep_fraction`; the advantages, losses and
  metrics count them as a text response's tokens), `rollout_log_probs` (N, T), and the decoded
  images under ``images``: a list of H x W x 3 uint8 numpy arrays (one per row; not a tensor, so it stays on the
  driver and never travels to the workers). That is what the reward function is given (`easyrl.diffusion.rewards`).

Departure from diffusers' pipeline call: the pipeline's own loop runs the deterministic Euler (ODE) sampler; here
each step is `easyrl.algorithms.flow_grpo.sde_step` with the noise drawn per row, as Flow-GRPO samples.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from easyrl.algorithms.flow_grpo import sde_step, train_steps_mask
from easyrl.batch import Batch
from easyrl.config.diffusion import KEY, DiffusionConfig
from easyrl.config.engines import BUILTIN_ENGINE_CAPABILITIES
from easyrl.diffusion.policy import LATENTS, NEGATIVE_FIELDS, SIGMAS, TEXT_FIELDS, TIMESTEPS, denoiser_velocity
from easyrl.rollout.engine import RolloutEngine, SamplingParams, copy_weights_into, seeds_of_prompts
from easyrl.rollout.registry import EngineContext, register_engine


logger = logging.getLogger(__name__)

PROMPT_TEXT = "raw_prompt"
"""The prompts' column the engine encodes: the rendered prompt text (the data section's template applied)."""


def sample_generators(prompts: Batch, params: SamplingParams) -> list[torch.Generator]:
    """One CPU generator per row (N = B * n), seeded with the prompt's seed + the sample's index: a row's noise is its
    own whatever batch it is in. CPU generators: the same draws on any device (the noise then moves to it)."""
    seeds = [s + j for s in seeds_of_prompts(prompts, params, unseeded=0) for j in range(params.n)]
    return [torch.Generator().manual_seed(s) for s in seeds]


class DiffusionRolloutEngine(RolloutEngine):
    """Samples a flow-matching pipeline's images with SDE steps and records each trajectory (module docstring)."""

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, config: DiffusionConfig) -> None:
        from diffusers import DiffusionPipeline

        self.device, self.dtype, self.config = device, dtype, config
        pipeline: Any = DiffusionPipeline.from_pretrained(model_path, dtype=dtype)
        if not hasattr(pipeline, "encode_prompt") or getattr(pipeline, "transformer", None) is None:
            raise ValueError(
                f"worker.actor.model.model_path={model_path!r} is a {type(pipeline).__name__}: the diffusers engine "
                "samples flow-matching pipelines with a `transformer` denoiser and `encode_prompt` (SD3-style)"
            )
        pipeline.set_progress_bar_config(disable=True)
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(pipeline, name, None)
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        self.pipeline = pipeline.to(device)
        self._params = dict(pipeline.transformer.named_parameters())

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        cfg, n = self.config, params.n
        texts: list[str] = list(prompts[PROMPT_TEXT])
        generators = sample_generators(prompts, params)
        guidance = cfg.guidance_scale
        guided = guidance > 1.0
        num_train = float(self.pipeline.scheduler.config.num_train_timesteps)
        features = self.encode(texts, guided)
        # every row of a prompt shares its prompt's features: (N, ...) by repeating each prompt's n times
        features = {k: v.repeat_interleave(n, dim=0) for k, v in features.items()}
        # (T+1,), from 1 (pure noise) down to 0; validation asks for its own count (`val_num_steps`)
        sigmas = self.schedule(params.denoising_steps or cfg.num_steps)
        num_rows, steps = len(generators), len(sigmas) - 1
        latents = [self.initial_noise(generators)]
        log_probs = torch.zeros(num_rows, steps)
        for t in range(steps):
            timestep = (sigmas[t] * num_train).expand(num_rows).to(self.device)
            # the same guided forward the update scores with: the rollout's log-probs are the trainer's to the bit
            velocity = denoiser_velocity(self.pipeline.transformer, latents[-1], timestep, features, guidance)
            noise = self.step_noise(generators, latents[-1])
            nxt, log_prob, _, _ = sde_step(
                velocity, latents[-1], sigmas[t], sigmas[t + 1], cfg.noise_level, noise=noise
            )
            latents.append(nxt)
            log_probs[:, t] = log_prob.float().cpu()
        # trained steps per row from the row's own seed (not from its generator: that would shift with num_steps)
        seeds = [s + j for s in seeds_of_prompts(prompts, params, unseeded=0) for j in range(n)]
        mask = torch.cat([train_steps_mask(1, steps, cfg.train_timestep_fraction, seed) for seed in seeds])
        images = self.decode(latents[-1])
        tensors = {
            LATENTS: torch.stack(latents, dim=1).float().cpu(),  # (N, T+1, C, h, w)
            SIGMAS: sigmas.expand(num_rows, -1).clone(),  # (N, T+1)
            TIMESTEPS: (sigmas * num_train).expand(num_rows, -1).clone(),  # what the denoiser is called with
            "response_mask": mask.to(torch.float32),  # (N, T)
            # what the advantages, losses and metrics count: the trained steps (as a single-turn text response's tokens)
            "loss_mask": mask.to(torch.float32),
            "rollout_log_probs": log_probs if params.logprobs else torch.zeros_like(log_probs),
            **{k: v.float().cpu() for k, v in features.items()},
        }
        return Batch(tensors=tensors, non_tensors={"images": images})

    def encode(self, texts: list[str], guided: bool) -> dict[str, torch.Tensor]:
        """The text features of each of `texts` (B rows), each distinct text encoded once."""
        distinct = list(dict.fromkeys(texts))
        cfg = self.config
        embeds, negative, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=distinct,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=guided,
            negative_prompt=[cfg.negative_prompt] * len(distinct) if guided else None,
            max_sequence_length=cfg.max_sequence_length,
        )
        where = torch.tensor([distinct.index(t) for t in texts], device=embeds.device)
        out = dict(zip(TEXT_FIELDS, (embeds[where], pooled[where])))
        if guided:
            out |= dict(zip(NEGATIVE_FIELDS, (negative[where], negative_pooled[where])))
        return out

    def schedule(self, num_steps: int) -> torch.Tensor:
        """The scheduler's sigmas for `num_steps` steps, (T+1,) ending at 0 (its shift applied)."""
        scheduler = self.pipeline.scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.detach().clone().float()

    def latent_shape(self) -> tuple[int, int, int]:
        pipe, cfg = self.pipeline, self.config
        scale = pipe.vae_scale_factor
        if cfg.height % scale or cfg.width % scale:
            raise ValueError(
                f"{KEY}.height/width {cfg.height}x{cfg.width} must be multiples of the VAE's scale factor {scale}"
            )
        return pipe.transformer.config.in_channels, cfg.height // scale, cfg.width // scale

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        shape = self.latent_shape()
        noise = torch.stack([torch.randn(shape, generator=g) for g in generators])
        return noise.to(self.device, self.dtype)

    def step_noise(self, generators: list[torch.Generator], like: torch.Tensor) -> torch.Tensor:
        noise = torch.stack([torch.randn(like.shape[1:], generator=g) for g in generators])
        return noise.to(like.device, like.dtype)

    def decode(self, latents: torch.Tensor) -> list[np.ndarray]:
        """Final latents (N, C, h, w) to H x W x 3 uint8 images, as the pipeline decodes them."""
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
        pixels = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
        # [-1, 1] to [0, 255]: the pipeline's image processor's denormalisation, then rounding to bytes
        arrays = ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return [a.permute(1, 2, 0).cpu().numpy() for a in arrays]

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The denoiser's new weights, under its own parameter names (``transformer``'s `named_parameters`)."""
        loaded = copy_weights_into(self._params, weights, "the diffusion engine's transformer")
        logger.debug("loaded %d tensors into the diffusion engine", loaded)

    def sleep(self) -> None:
        """Move the pipeline to host memory while the policy trains (the weights stay: nothing to reload)."""
        if self.device.type != "cpu":
            self.pipeline.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.device.type != "cpu":
            self.pipeline.to(self.device)

    def recover(self) -> bool:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.pipeline is not None

    def discard(self) -> None:
        self.pipeline, self._params = None, {}


# Registered here, not in `easyrl.rollout.registry` with hf and vllm: this engine stands on the diffusion room's
# guided forward, and the rollout room imports nothing above it. Its host, the denoiser actor, imports this module.
@register_engine("diffusers", capabilities=BUILTIN_ENGINE_CAPABILITIES["diffusers"])
def _diffusers_engine(ctx: EngineContext) -> RolloutEngine:
    model = ctx.spec.model
    assert model.model_path is not None
    return DiffusionRolloutEngine(model.model_path, ctx.device, ctx.dtype, ctx.spec.config.diffusion)
