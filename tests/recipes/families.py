"""The model families: each tiny model trains 2 GRPO steps through the engine it runs on in production (vLLM; the
Omni thinkers on the HF engine), and the parameters the family is about must move (q/k norms, routed experts and
their routers, the vision tower, the Gated DeltaNet layers, the audio tower), so the media really reached the model."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from tests.recipes.base import GAE, Context, Outcome, Recipe, expect, moved


def text_model(ctx: Context, arch: str) -> str:
    from easyrl.testing.tiny import build_tiny_checkpoint

    # 2 query heads and 1 key/value head of 32: vLLM's attention kernels reject head size 16
    return ctx.built(arch, lambda folder: build_tiny_checkpoint(folder, arch, num_heads=2, num_kv_heads=1))


def vl_model(ctx: Context, arch: str, linear_head: int | None = None) -> str:
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    # head size 32 in the language model and the vision tower (vLLM's kernels reject 16)
    kwargs: dict[str, Any] = {"num_heads": 2, "num_kv_heads": 1, "vision_hidden_size": 64}
    if linear_head is not None:  # the Gated DeltaNet heads' size (the published Qwen3.5 models: 128)
        kwargs["text_overrides"] = {"linear_key_head_dim": linear_head, "linear_value_head_dim": linear_head}
    key = f"{arch}_{linear_head}" if linear_head else arch
    return ctx.built(key, lambda folder: build_tiny_vl_checkpoint(folder, arch, **kwargs))


def _digits(ctx: Context) -> dict[str, str]:
    import json

    def build(folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        rows = [{"prompt": f"Copy: {a} {b} {c}", "answer": f"{a}{b}{c}"} for a in range(4) for b in range(4) for c in range(4)]  # fmt: skip
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder / "train.jsonl")

    return {"train": ctx.built("digits", build)}


def digits_recipe_data(ctx: Context) -> dict[str, str]:
    """The digit-copy task of the tests (64 prompts), built once per process."""
    return _digits(ctx)


def image_recipe_data(ctx: Context) -> tuple[dict[str, str], dict[str, Any]]:
    from tests.trainer.test_vl_e2e import _image_data, vl_edits

    folder = Path(ctx.built("images", lambda f: _image_data(f)["image_dir"])).parent
    data = {"train": str(folder / "train.jsonl"), "image_dir": str(folder / "images")}
    return {"train": data["train"]}, vl_edits(data)


def _videos(ctx: Context) -> tuple[dict[str, str], dict[str, Any]]:
    from tests.workers.test_rollout_vl_vllm import _video_data

    folder = Path(ctx.built("videos", lambda f: _video_data(f)["video_dir"]))
    edits = {
        "data.video_dir": str(folder),
        "data.max_prompt_length": 256,
        "data.min_pixels": 16 * 16,
        "data.max_pixels": 64 * 64,
        "data.video_fps": 2.0,
    }
    return {"train": str(folder / "train.jsonl")}, edits


def text_family(ctx: Context, arch: str, parts: tuple[str, ...], one_mini_batch: bool = False) -> Outcome:
    # one mini-batch a step: no old-log-prob pass, the update's own forward measures the engine
    edits = {"worker.actor.global_batch_size": 4} if one_mini_batch else {}
    rows, before, after = ctx.train(text_model(ctx, arch), _digits(ctx), edits, weights=True)
    still = [p for p in parts if not moved(before, after, p)]
    expect(not still, f"{arch}: no gradient reached {still}")
    if one_mini_batch:
        expect(all("timing_s/old" not in r for r in rows), "one mini-batch ran the old-log-prob pass")
    how = "; no old pass: measured in the update's forward" if one_mini_batch else ""
    return Outcome(f"moved: {', '.join(parts)}{how}", rows)


def vl_family(ctx: Context, arch: str, parts: tuple[str, ...], media: str = "image", linear_head: int | None = None) -> Outcome:  # fmt: skip
    data, edits = image_recipe_data(ctx) if media == "image" else _videos(ctx)
    rows, before, after = ctx.train(vl_model(ctx, arch, linear_head), data, edits, weights=True)
    still = [p for p in parts if not moved(before, after, p)]
    expect(not still, f"{arch}: no gradient reached {still} (no {media} pixels?)")
    prompt = rows[0]["prompt_length/mean"]
    expect(prompt > 40, f"{arch}: prompts of {prompt:.0f} tokens: the {media} tokens were not expanded")
    return Outcome(f"moved: {', '.join(parts)}; {media} prompts {prompt:.0f} tokens", rows)


def _train_omni(ctx: Context, variant: str, **edits: Any) -> tuple[list[dict[str, Any]], dict | None, dict | None]:
    """The Omni thinker's run on the audio rows through the HF engine: (metric rows, weights before, after)."""
    from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint
    from tests.models.test_omni import audio_data

    model = ctx.built(variant, lambda folder: build_tiny_omni_checkpoint(folder, variant=variant))
    audio = Path(ctx.built("audio", lambda folder: audio_data(folder)["audio_dir"]))
    edits = {"data.audio_dir": str(audio), "data.max_prompt_length": 128, **edits}
    return ctx.train(model, {"train": str(audio.parent / "train.jsonl")}, edits, engine="hf", weights=True)


def omni_family(ctx: Context, variant: str, critic: bool = False) -> Outcome:
    """`critic`: PPO with GAE, the thinker under a value head as its critic (`ThinkerValueModel`)."""
    rows, before, after = _train_omni(ctx, variant, **(GAE if critic else {}))
    expect(moved(before, after, "audio_tower."), f"{variant}: the audio tower got no gradient: no audio?")
    parts = "audio tower" + (", routed experts" if variant == "qwen3_omni_moe" else "")
    if variant == "qwen3_omni_moe":
        expect(moved(before, after, ".experts."), f"{variant}: the routed experts got no gradient")
    if critic:
        losses = [r.get("critic/vf_loss") for r in rows]
        expect(all(v is not None and v > 0 for v in losses), f"{variant}: critic/vf_loss {losses}")
        parts += f"; thinker critic vf_loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    return Outcome(f"moved: {parts}; prompts {rows[0]['prompt_length/mean']:.0f} tokens", rows)


def omni_lora(ctx: Context, variant: str) -> Outcome:
    """LoRA (rank 8, `all-linear`) on an Omni thinker through the HF engine on the GPU: the adapters land on the
    language layers only (the audio and vision towers stay as loaded), and the merged policy reaches the engine
    (the numerics gate's policy versions)."""
    rows, before, after = _train_omni(ctx, variant, **{"worker.actor.model.lora.rank": 8})
    expect(moved(before, after, "model.layers."), f"{variant} LoRA: the language layers did not move")
    expect(not moved(before, after, "audio_tower."), f"{variant} LoRA: the audio tower moved (adapted?)")
    expect(not moved(before, after, "visual."), f"{variant} LoRA: the vision tower moved (adapted?)")
    experts = "" if variant != "qwen3_omni_moe" else ", nor the routed experts"
    if experts:  # left out of the adapters as on every MoE model
        expect(not moved(before, after, ".experts."), f"{variant} LoRA: the routed experts moved (adapted?)")
    return Outcome(f"LoRA on the Omni thinker: language layers moved, audio and vision towers not{experts}", rows)


def _family(name: str, run: Any, limit_s: float = 45.0, cpu: bool = True) -> Recipe:
    return Recipe(name, "family", run, limit_s, cpu)


FAMILIES = (
    _family(
        "qwen2_5",
        partial(text_family, arch="qwen2", parts=("self_attn.q_proj.", "mlp.gate_proj."), one_mini_batch=True),
    ),
    _family("qwen3", partial(text_family, arch="qwen3", parts=("self_attn.q_norm.", "mlp.gate_proj."))),
    _family("qwen3_moe", partial(text_family, arch="qwen3_moe", parts=("mlp.experts.", "mlp.gate."))),
    _family("qwen2_5_vl_image", partial(vl_family, arch="qwen2_5_vl", parts=("visual.",))),
    _family("qwen2_5_vl_video", partial(vl_family, arch="qwen2_5_vl", parts=("visual.",), media="video")),
    _family(
        "qwen3_vl", partial(vl_family, arch="qwen3_vl", parts=("visual.deepstack_merger_list.", "self_attn.q_norm."))
    ),
    _family("qwen3_vl_moe", partial(vl_family, arch="qwen3_vl_moe", parts=("mlp.experts.", "mlp.gate.", "visual."))),
    # Gated DeltaNet heads of 128 as published (the kernels vLLM picks by head size), and a small one
    _family("qwen3_5", partial(vl_family, arch="qwen3_5", parts=("linear_attn.", "visual."), linear_head=128)),
    _family("qwen3_5_small_heads", partial(vl_family, arch="qwen3_5", parts=("linear_attn.", "self_attn."))),
    _family(
        "qwen3_5_moe",
        partial(
            vl_family,
            arch="qwen3_5_moe",
            parts=("linear_attn.", "mlp.experts.", "mlp.shared_expert."),
            linear_head=128,
        ),
    ),
    _family("qwen2_5_omni", partial(omni_family, variant="qwen2_5_omni"), limit_s=60),
    _family("qwen3_omni_moe", partial(omni_family, variant="qwen3_omni_moe"), limit_s=60),
    _family("qwen2_5_omni_lora", partial(omni_lora, variant="qwen2_5_omni"), limit_s=60),
    _family("qwen3_omni_moe_gae", partial(omni_family, variant="qwen3_omni_moe", critic=True), limit_s=60),
    _family("qwen3_omni_moe_lora", partial(omni_lora, variant="qwen3_omni_moe"), limit_s=60),
)
