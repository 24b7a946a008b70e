"""`easyrl check` on a diffusion config: one reward call on a sampled image, the plan, and the denoiser's memory
plan; the GPU recipes (SD3.5-Medium, Wan2.1-T2V-1.3B) fit their GPUs with their published configs alone."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from tests.conftest import REPO


def _run(args: list[str]) -> tuple[int, str]:
    from easyrl.cli import main

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


def _tiny_config(tmp_path: Path, reward: str = "reward_functions/image_colour.py:compute_score") -> list[str]:
    pipe = build_tiny_sd3_pipeline(tmp_path / "sd3", seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a red square", "answer": "red"}\n' * 4)
    config = tmp_path / "c.yaml"
    config.write_text("{}")
    return ["check", str(config), f"worker.actor.model.model_path={pipe}", f"data.train_files={data}",
            f"data.val_files={data}", f"worker.reward.reward_function={REPO / reward}", "data.rollout_batch_size=2",
            "worker.actor.global_batch_size=2", "worker.rollout.n=2", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1", "worker.rollout.diffusion.height=32", "worker.rollout.diffusion.width=32",
            "worker.rollout.diffusion.max_sequence_length=8"]  # fmt: skip


def test_check_scores_one_sampled_image_and_plans_the_denoiser(tmp_path: Path) -> None:
    code, text = _run([*_tiny_config(tmp_path), "--gpu-memory", "1"])
    assert code == 0, text
    import ast

    line = next(x for x in text.splitlines() if "on one sample (1x32x32x3, 2 steps)" in x)
    scores = ast.literal_eval(line.split(": ", 1)[1])  # the printed dict of scores
    assert 0 < scores["overall"] < 1 and scores["named"] == 1.0
    assert "actor: the denoiser (every weight) under FSDP2 on 1 cpu worker(s)" in text
    assert "while sampling:" in text and "while updating:" in text and "memory error" not in text


def test_a_reward_that_cannot_read_images_is_one_line(tmp_path: Path) -> None:
    reward = tmp_path / "wrong_key.py"  # written for another contract: a tensor under `images`
    reward.write_text(
        "def compute_score(items):\n    return [{'overall': float(i['images'].mean())} for i in items]\n"
    )
    code, text = _run(_tiny_config(tmp_path, f"{reward}:compute_score"))
    assert code == 2 and "easyrl: reward error:" in text, text


# The published config.json fields of the components the GPU recipes load, written from what is known of them here
# (not downloaded); a field that differs moves the figures, not whether the plan fits by a wide margin.
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77}  # fmt: skip
_CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
           "projection_dim": 1280, "vocab_size": 49408, "max_position_embeddings": 77}  # fmt: skip
_T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
           "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False}  # fmt: skip
_UMT5_XXL = {**_T5_XXL, "vocab_size": 256384}
PUBLISHED = {
    "sd3_5_medium": {
        "_class_name": "StableDiffusion3Pipeline",
        "transformer": ("SD3Transformer2DModel", {"num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
                        "joint_attention_dim": 4096, "caption_projection_dim": 1536, "pooled_projection_dim": 2048,
                        "in_channels": 16, "out_channels": 16, "patch_size": 2, "sample_size": 128, "pos_embed_max_size":
                        384, "qk_norm": "rms_norm", "dual_attention_layers": list(range(13))}),
        "vae": ("AutoencoderKL", {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels":
                [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types":
                ["UpDecoderBlock2D"] * 4, "layers_per_block": 2, "use_quant_conv": False, "use_post_quant_conv": False}),
        "text_encoder": ("CLIPTextModelWithProjection", _CLIP_L),
        "text_encoder_2": ("CLIPTextModelWithProjection", _CLIP_G),
        "text_encoder_3": ("T5EncoderModel", _T5_XXL),
    },
    "wan2_1_t2v_1_3b": {
        "_class_name": "WanPipeline",
        "transformer": ("WanTransformer3DModel", {"num_layers": 30, "attention_head_dim": 128, "num_attention_heads":
                        12, "ffn_dim": 8960, "freq_dim": 256, "in_channels": 16, "out_channels": 16, "patch_size":
                        [1, 2, 2], "text_dim": 4096, "cross_attn_norm": True, "eps": 1e-6, "qk_norm": "rms_norm_across_heads"}),
        "vae": ("AutoencoderKLWan", {"base_dim": 96, "z_dim": 16, "scale_factor_spatial": 8,
                                      "scale_factor_temporal": 4}),
        "text_encoder": ("UMT5EncoderModel", _UMT5_XXL),
    },
}  # fmt: skip

# (recipe, published pipeline, denoiser parameters, GiB while sampling, GiB while updating) on GPUs of 80 GiB
RECIPE_PLANS = [
    ("sd3_5_medium_colour_grpo", "sd3_5_medium", "2.24B", "19.7", "17.2"),
    ("wan2_1_t2v_1_3b_colour_grpo", "wan2_1_t2v_1_3b", "1.42B", "17.1", "18.8"),
]


def _published_folder(root: Path, name: str) -> Path:
    """A pipeline folder with the published configs alone (no weights, no tokenizer files)."""
    import diffusers
    import torch
    import transformers

    spec = PUBLISHED[name]
    index: dict[str, object] = {"_class_name": spec["_class_name"], "_diffusers_version": diffusers.__version__}
    for part, value in spec.items():
        if part == "_class_name":
            continue
        assert isinstance(value, tuple)
        cls_name, fields = value
        folder = root / name / part
        if hasattr(diffusers, cls_name):
            with torch.device("meta"):  # the config with its defaults filled in; real weights took ~25 CPU-s
                getattr(diffusers, cls_name).from_config(fields).save_config(folder)
            index[part] = ["diffusers", cls_name]
        else:
            getattr(transformers, cls_name).config_class(**fields).save_pretrained(folder)
            index[part] = ["transformers", cls_name]
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler" if "SD3" in str(spec["_class_name"])
                          else "UniPCMultistepScheduler"]  # fmt: skip
    (root / name / "model_index.json").write_text(json.dumps(index))
    return root / name


@pytest.mark.parametrize(("recipe", "model", "params", "sampling", "updating"), RECIPE_PLANS, ids=lambda v: str(v))
def test_recipe_fits_its_gpus(recipe: str, model: str, params: str, sampling: str, updating: str,
                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The recipe loads and validates with the pipeline folder holding only the published configs, and its memory
    plan on 80 GiB GPUs finds no problem (the plan reads the configs alone)."""
    from easyrl.config import load_config
    from easyrl.diffusion_check import print_diffusion_memory_plan

    monkeypatch.chdir(REPO)
    folder = _published_folder(tmp_path, model)
    cfg = load_config(REPO / "configs" / "diffusion" / f"{recipe}.yaml", [f"worker.actor.model.model_path={folder}"])
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = print_diffusion_memory_plan(cfg, gpu_memory_gib=80)
    text = out.getvalue()
    assert code == 0 and "memory error" not in text, text
    assert f"denoiser: {params} parameters" in text, text
    assert f"while sampling: {sampling} of 80.0 GiB; while updating: {updating} of 80.0 GiB" in text, text
