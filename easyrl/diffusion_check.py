"""`easyrl check` for a diffusion config: the first prompt, one reward call on an image the pipeline samples for it
at the config's resolution (a step or two: the reward's contract is checked, not the image's quality), the plan of
roles and devices, and the denoiser's memory plan (`easyrl.diffusion_memory`)."""

from __future__ import annotations

import sys
from typing import Any

from easyrl.config import EasyRLConfig
from easyrl.diffusion_memory import (
    PipelineShape,
    diffusion_plan_lines,
    diffusion_plan_problems,
    plan_diffusion_memory,
)


CHECK_STEPS = 2
"""Denoising steps of the image `check` scores (at most `num_steps`)."""


def first_prompt(cfg: EasyRLConfig) -> tuple[dict[str, Any], str]:
    """(the first training row, its prompt text: the prompt column through `data.format_prompt` when set)."""
    from easyrl.data.loading import load_rows
    from easyrl.data.prompts import load_prompt_template
    from easyrl.data.template_guard import render_with_deadline

    assert cfg.data.train_files
    row = dict(load_rows(cfg.data.train_files)[0][2])
    prompt = row[cfg.data.prompt_key]
    if cfg.data.format_prompt:
        prompt = render_with_deadline(load_prompt_template(cfg.data.format_prompt), {**row, "content": prompt})
    return row, str(prompt)


def sample_for_check(cfg: EasyRLConfig, prompt: str) -> Any:
    """One sample of `prompt` from the pipeline at the config's size: its frames, F x H x W x 3 uint8 RGB (F = 1 for
    an image pipeline)."""
    import torch
    from diffusers import DiffusionPipeline

    diff = cfg.worker.rollout.diffusion
    pipe = DiffusionPipeline.from_pretrained(cfg.worker.actor.model.model_path)
    kwargs: dict[str, Any] = {"height": diff.height, "width": diff.width, "output_type": "pt"}
    if diff.num_frames > 1:
        kwargs["num_frames"] = diff.num_frames
    out = pipe(
        [prompt],
        num_inference_steps=min(CHECK_STEPS, diff.num_steps),
        guidance_scale=diff.guidance_scale,
        max_sequence_length=diff.max_sequence_length,
        generator=torch.Generator().manual_seed(cfg.data.seed),
        **kwargs,
    )
    images = torch.as_tensor(out.frames if hasattr(out, "frames") else out.images)[0].float()
    frames = images.unsqueeze(0) if images.ndim == 3 else images  # (F, 3, H, W) in [0, 1]: an image is one frame
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def diffusion_plan_lines_of(cfg: EasyRLConfig) -> list[str]:
    """Roles and devices of the run."""
    from easyrl.config.algorithm import KLMode

    w, t, diff = cfg.worker, cfg.trainer, cfg.worker.rollout.diffusion
    gpus = t.n_gpus_per_node * t.nnodes
    lora = w.actor.model.lora
    ref = (
        "none (KL off)"
        if cfg.algorithm.kl_mode == KLMode.OFF
        else "the actor with its adapters off"
        if lora.rank
        else "the base denoiser, sharded like the actor"
    )
    trains = f"LoRA rank {lora.rank} adapters" if lora.rank else "every weight"
    return [
        f"algorithm: {cfg.algorithm.adv_estimator} advantages over each prompt's {w.rollout.n} samples, "
        f"{w.actor.loss_type} loss over {diff.train_timestep_fraction:g} of {diff.num_steps} denoising steps, "
        f"SDE noise level {diff.noise_level:g}, guidance {diff.guidance_scale:g}",
        f"actor: the denoiser ({trains}) under FSDP2 on {gpus} {t.device} worker(s); text encoders and VAE frozen",
        f"rollout: the pipeline sampling in the actor's processes; reference: {ref}",
        f"reward: {w.reward.reward_function} on the decoded {'videos' if diff.num_frames > 1 else 'images'}",
    ]


def run_diffusion_check(cfg: EasyRLConfig, gpu_memory_gib: float | None = None) -> int:
    """Print the check of a diffusion config; 2 with one line when the reward cannot score a sample."""
    from easyrl.rewards import RewardError, RewardLoadError, RewardManager

    out = sys.stdout
    row, prompt = first_prompt(cfg)
    print("== first prompt", file=out)
    print(prompt, file=out)
    print("== reward function", file=out)
    images = sample_for_check(cfg, prompt)
    # The trainer's diffusion reward inputs (docs/diffusion.md): the row, `prompt`, `ground_truth`, `image` (H x W x 3
    # uint8) and, from a video pipeline, `video` (F x H x W x 3).
    sample = {**row, "prompt": prompt, "image": images[0], "ground_truth": row.get(cfg.data.answer_key)}
    if images.shape[0] > 1:
        sample["video"] = images
    try:
        with RewardManager(cfg.worker.reward) as manager:
            scores, _ = manager.score([sample])
    except (RewardLoadError, RewardError) as exc:
        print(f"easyrl: reward error: {exc}", file=sys.stderr)
        return 2
    size = "x".join(str(s) for s in images.shape)
    print(f"{cfg.worker.reward.reward_function} on one sample ({size}, {CHECK_STEPS} steps): {scores[0]}", file=out)
    print("== plan", file=out)
    for line in diffusion_plan_lines_of(cfg):
        print(line, file=out)
    return print_diffusion_memory_plan(cfg, gpu_memory_gib)


def print_diffusion_memory_plan(cfg: EasyRLConfig, gpu_memory_gib: float | None) -> int:
    """The denoiser's memory plan on a GPU of `gpu_memory_gib` GiB (else this machine's, if it has one); 2 with
    the problems when it does not fit."""
    import torch

    from easyrl.memory_plan import GiB

    if gpu_memory_gib is not None:
        total = int(gpu_memory_gib * GiB)
    elif torch.cuda.is_available() and cfg.trainer.device != "cpu":
        total = torch.cuda.mem_get_info()[1]
    else:
        return 0
    assert cfg.worker.actor.model.model_path is not None
    shape = PipelineShape.from_folder(cfg.worker.actor.model.model_path)
    plan = plan_diffusion_memory(shape, cfg, total)
    print("== memory plan (one GPU, estimates: easyrl/diffusion_memory.py)", file=sys.stdout)
    for line in diffusion_plan_lines(shape, plan, cfg):
        print(line, file=sys.stdout)
    problems = diffusion_plan_problems(plan)
    for problem in problems:
        print(f"easyrl: memory error: {problem}", file=sys.stderr)
    return 2 if problems else 0
