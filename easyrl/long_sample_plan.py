"""The memory plan of one long sample (an hour of video: ~256k tokens) per rank: pure arithmetic, printed by
`easyrl check` and refused there and at train start when it cannot fit.

A sample of T = ``data.max_prompt_length + data.max_response_length`` tokens is one packed row. Under sequence
parallelism of ``ulysses_size`` x ``ring_size`` ranks (SP), each rank holds t = ceil(T / SP) of its tokens, whatever
the split (Ulysses trades tokens for heads inside attention, which keeps each rank's element count; ring attention
keeps the tokens and passes key/value blocks around). Per rank, in bytes:

- the update: the actor's training state and activations of a micro-batch of t tokens, exactly as
  `easyrl.memory_plan.plan_memory` computes them (gradient checkpointing, the log-prob head, the reference, the CUDA
  graphs and contexts that stay resident), plus with a ring the key/value block in flight and the one arriving:
  2 x t x 2 x KV x (activation dtype bytes);
- the vision tower's encode of the sample's video, its frames shared out over the SP ranks (`easyrl.models.vl_embeds`:
  each rank encodes 1/SP of the clip's patches, then one all-gather gives every rank the tower's whole output,
  video tokens x the tower's output width): the clip's patches P = video tokens x merge^2, where the video tokens are at most ``data.max_pixels`` / (patch x
  merge)^2 (the pixel budget is shared by the clip's temporal patches, `easyrl.data.multimodal._frame_budget`) and at
  most T; per rank, its share p = ceil(P / SP) of the input, p x 3 x temporal patch x patch^2 in fp32, and one
  block's working set p x (6 Hv + 3 Iv) (activation dtype; flash/sdpa attention within each frame keeps no P x P
  matrix); a trained tower (``freeze_vision_tower`` false) also keeps each block's input for the backward:
  depth x p x Hv; plus the gathered output, video tokens x Ho (activation dtype);
- the engine's KV cache for the sample: T x 2 x KV layers x KV heads / tensor parallel x head dim x (engine dtype
  bytes), which must fit the KV cache the engine's budget leaves (vLLM refuses a max_model_len it cannot hold once).

Shown for samples of at least `LONG_SAMPLE_TOKENS` tokens (below that the ordinary plan says it all).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from easyrl.memory_plan import DTYPE_BYTES, GiB, ModelShape, plan_memory


LONG_SAMPLE_TOKENS = 32768
"""Samples this long (prompt + response) get the long-sample plan in `easyrl check` and at train start."""


@dataclass(frozen=True)
class VisionShape:
    """The dimensions of a Qwen-VL vision tower that set its encode memory."""

    hidden_size: int
    depth: int
    intermediate_size: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    out_hidden_size: int = 0
    """The width of the tower's merged output tokens (the language model's hidden size for Qwen2.5-VL)."""

    @classmethod
    def from_hf_config(cls, config: Any) -> VisionShape | None:
        """The tower of a HF vision-language config; None for a text model."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        return cls(
            hidden_size=int(vision.hidden_size),
            depth=int(vision.depth),
            intermediate_size=int(vision.intermediate_size),
            patch_size=int(vision.patch_size),
            merge_size=int(vision.spatial_merge_size),
            temporal_patch_size=int(vision.temporal_patch_size),
            # Qwen2.5-VL and Qwen3-VL name it out_hidden_size; Qwen2-VL's merger outputs the text model's width
            out_hidden_size=int(
                getattr(vision, "out_hidden_size", 0)
                or getattr(getattr(config, "text_config", config), "hidden_size", 0)
                or 0
            ),
        )


@dataclass(frozen=True)
class LongSamplePlan:
    """One long sample's memory per rank (bytes); see the module docstring for each term."""

    sample_tokens: int
    ulysses_size: int
    ring_size: int
    tokens_per_rank: int
    update: int
    """The update of t tokens with everything resident meanwhile (`MemoryPlan.updating`)."""
    activations: int
    """The actor's activations of those t tokens (inside `update`)."""
    ring_buffers: int
    video_tokens: int
    vision_encode: int
    kv_sample: int
    kv_cache: int
    """The engine's KV cache (what its budget leaves after its weights and CUDA graphs)."""
    device_total: int

    @property
    def per_rank(self) -> int:
        """What one rank holds at the update's peak: the update, the ring's blocks and the tower's encode."""
        return self.update + self.ring_buffers + self.vision_encode

    @property
    def fits(self) -> bool:
        return self.per_rank <= self.device_total and self.kv_sample <= self.kv_cache


def sp_sizes(cfg: Any) -> tuple[int, int]:
    """(ulysses_size, ring_size) of the actor."""
    actor = cfg.worker.actor
    return int(actor.ulysses_size), int(actor.ring_size)


def video_token_bound(cfg: Any, vision: VisionShape | None, sample_tokens: int) -> int:
    """The most video tokens a sample can carry: the clip's shared pixel budget over one merged token's pixels (at
    least a token per temporal patch of ``data.max_frames``), and never more than the sample."""
    if vision is None:
        return 0
    merged_pixels = (vision.patch_size * vision.merge_size) ** 2
    groups = max(1, cfg.data.max_frames // vision.temporal_patch_size)
    return min(sample_tokens, max(groups, cfg.data.max_pixels // merged_pixels))


def vision_encode_bytes(
    vision: VisionShape | None, video_tokens: int, act: int, trained: bool, sp_size: int = 1
) -> int:
    """Encode memory on one of `sp_size` ranks of a clip of `video_tokens` merged tokens: its share of the input
    patches (fp32), one block's working set and, when the tower trains (gradient checkpointing), the blocks' inputs,
    plus the gathered output of the whole clip — see the module docstring."""
    if vision is None or video_tokens == 0:
        return 0
    patches = -(-video_tokens * vision.merge_size**2 // max(1, sp_size))  # this rank's share of the frames
    hv, iv = vision.hidden_size, vision.intermediate_size
    pixels = patches * 3 * vision.temporal_patch_size * vision.patch_size**2 * DTYPE_BYTES["fp32"]
    working = patches * (6 * hv + 3 * iv) * act
    kept = vision.depth * patches * hv * act if trained else 0
    gathered = video_tokens * vision.out_hidden_size * act
    return pixels + working + kept + gathered


def plan_long_sample(
    shape: ModelShape, vision: VisionShape | None, cfg: Any, device_total: int, sample_tokens: int | None = None
) -> LongSamplePlan:
    """The per-rank plan of one sample of `sample_tokens` (default: the longest the config admits) on GPUs of
    `device_total` bytes."""
    tokens = int(sample_tokens or cfg.data.max_prompt_length + cfg.data.max_response_length)
    ulysses, ring = sp_sizes(cfg)
    per_rank = -(-tokens // (ulysses * ring))
    # the ordinary plan, with one micro-batch of this rank's share of the sample
    trial = copy.deepcopy(cfg)
    trial.worker.actor.dynamic_batching = True
    trial.worker.actor.max_token_len_per_gpu = per_rank
    base = plan_memory(shape, trial, device_total)
    act = DTYPE_BYTES[cfg.worker.actor.fsdp.mp_param_dtype]
    ring_buffers = 2 * per_rank * 2 * shape.kv_size * act if ring > 1 else 0
    video = video_token_bound(cfg, vision, tokens)
    trained = not cfg.worker.actor.model.freeze_vision_tower
    engine_dtype = DTYPE_BYTES[cfg.worker.rollout.dtype]
    tp = max(1, cfg.worker.rollout.tensor_parallel_size)
    kv_per_token = 2 * shape.kv_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * engine_dtype
    return LongSamplePlan(
        sample_tokens=tokens,
        ulysses_size=ulysses,
        ring_size=ring,
        tokens_per_rank=per_rank,
        update=base.updating,
        activations=base.actor.activations,
        ring_buffers=ring_buffers,
        video_tokens=video,
        vision_encode=vision_encode_bytes(vision, video, act, trained, ulysses * ring),
        kv_sample=tokens * kv_per_token,
        kv_cache=base.kv_cache,
        device_total=device_total,
    )


def _g(value: int) -> str:
    return f"{value / GiB:.1f}"


def long_sample_lines(plan: LongSamplePlan) -> list[str]:
    """The plan as `easyrl check` prints it (GiB)."""
    return [
        f"long sample: {plan.sample_tokens} tokens over ulysses {plan.ulysses_size} x ring {plan.ring_size}: "
        f"{plan.tokens_per_rank} tokens per rank",
        f"per rank: update {_g(plan.update)} GiB (activations {_g(plan.activations)}) + ring blocks "
        f"{_g(plan.ring_buffers)} + vision tower encode {_g(plan.vision_encode)} ({plan.video_tokens} video tokens, "
        f"frames split over the group) = {_g(plan.per_rank)} of {_g(plan.device_total)} GiB",
        f"engine KV cache for the sample: {_g(plan.kv_sample)} of {_g(plan.kv_cache)} GiB",
    ]


def long_sample_problem(plan: LongSamplePlan) -> str | None:
    """One line when the sample cannot fit, naming its tokens, the per-rank bound and the levers; None when it fits."""
    if plan.fits:
        return None
    needs, levers = [], []
    if plan.per_rank > plan.device_total:
        needs.append(f"{_g(plan.per_rank)} GiB per rank (bound {_g(plan.device_total)} GiB)")
        levers.append("raise worker.actor.ulysses_size or worker.actor.ring_size")
    if plan.kv_sample > plan.kv_cache:
        needs.append(f"{_g(plan.kv_sample)} GiB of engine KV cache (it has {_g(plan.kv_cache)} GiB)")
        levers.append("raise worker.rollout.tensor_parallel_size or gpu_memory_utilization")
    levers.append("lower data.max_frames, data.video_fps or data.max_pixels (and data.max_prompt_length with them)")
    return (
        f"a sample of {plan.sample_tokens} tokens (data.max_prompt_length + data.max_response_length) needs "
        f"{' and '.join(needs)} with ulysses {plan.ulysses_size} x ring {plan.ring_size} "
        f"({plan.tokens_per_rank} tokens per rank): {', or '.join(levers)}"
    )
