"""`easyrl merge` of a diffusion run's checkpoint: the denoiser's shards (or LoRA adapters) written by the actor's own
checkpoint writer become a diffusers folder that `DiffusionPipeline.from_pretrained` loads with the trained weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from torch import nn

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.manager import RUN_CONFIG, CheckpointManager
from easyrl.checkpoint.worker import HF_DIR, LORA_FILE, save_worker_state
from easyrl.diffusion.merge import write_pipeline_files
from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from easyrl.merge import main as merge_main
from easyrl.merge import merge_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_sd3_pipeline(tmp_path_factory.mktemp("base") / "sd3", seed=5))


def _save(run: Path, transformer: nn.Module, base: str, lora: dict | None = None, side_files: bool = True) -> Path:
    """One actor checkpoint of `transformer`, written as the actor writes it (rank 0 of 1) and sealed by the
    manager."""
    manager = CheckpointManager(str(run))
    tmp = manager.begin(1)
    role = os.path.join(tmp, "actor")
    save_worker_state(role, transformer, None, None, rank=0, world=1, trainable_only=lora is not None)
    if side_files:
        write_pipeline_files(os.path.join(role, HF_DIR), transformer, base)
    else:  # a checkpoint without pipeline.json: the run's saved config names the pipeline
        fsio.write_json(os.path.join(tmp, RUN_CONFIG), {"worker": {"actor": {"model": {"model_path": base}}}})
    if lora is not None:
        fsio.write_json(os.path.join(role, LORA_FILE), lora)
    return Path(manager.commit(tmp, 1))


def _load_transformer(base: str) -> nn.Module:
    return DiffusionPipeline.from_pretrained(base).transformer


def test_a_trained_denoiser_merges_into_a_pipeline_that_loads(base: str, tmp_path: Path) -> None:
    transformer = _load_transformer(base)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.01 * torch.randn_like(param))  # "trained": every weight moved
    step = _save(tmp_path / "run", transformer, base)
    out = merge_checkpoint(str(step), str(tmp_path / "merged"), max_shard_bytes=20_000)  # several shard files
    assert any(name.endswith(".index.json") for name in os.listdir(Path(out) / "transformer"))
    merged = DiffusionPipeline.from_pretrained(out)
    original = DiffusionPipeline.from_pretrained(base)
    want = transformer.state_dict()
    got = merged.transformer.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], v) for k, v in original.transformer.state_dict().items())
    for part in ("vae", "text_encoder", "text_encoder_3"):  # the frozen components are the base's own
        a, b = getattr(merged, part).state_dict(), getattr(original, part).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b)
    images = merged(["a red square"], num_inference_steps=1, max_sequence_length=8, output_type="pt").images
    assert images.shape == (1, 3, 32, 32)


def test_lora_adapters_are_folded_into_the_base_denoiser(base: str, tmp_path: Path) -> None:
    from easyrl.config.worker import LoraConfig, ModelConfig
    from easyrl.workers.lora import adapter_description, apply_lora, merged_weights

    transformer = _load_transformer(base)
    lora_cfg = LoraConfig(rank=2, alpha=4, target_modules="to_q,to_v")
    apply_lora(transformer, lora_cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:  # B starts at zero: a trained adapter has moved it
                param.copy_(torch.randn_like(param))
    info = adapter_description(transformer, ModelConfig(model_path=base, lora=lora_cfg))
    step = _save(tmp_path / "run", transformer, base, info)
    merged = DiffusionPipeline.from_pretrained(merge_checkpoint(str(step), str(tmp_path / "merged")))
    want = dict(merged_weights(transformer))  # the LLM path's own fold of the adapters
    got = merged.transformer.state_dict()
    assert set(got) == set(want) | {"pos_embed.pos_embed"}  # merged_weights yields parameters, not buffers
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert not torch.equal(got[next(k for k in want if "to_q" in k)], _load_transformer(base).state_dict()[
        next(k for k in want if "to_q" in k)])  # fmt: skip


def test_a_missing_base_pipeline_is_one_line(base: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    step = _save(tmp_path / "run", _load_transformer(base), base)
    assert merge_main([str(step), "--output", str(tmp_path / "m"), "--base-model", str(tmp_path)]) == 1
    assert "has no model_index.json: pass the pipeline folder with --base-model" in caplog.text
    with pytest.raises(CheckpointError, match="--adapter-only: a diffusion checkpoint"):
        merge_checkpoint(str(step), str(tmp_path / "m"), adapter_only=True)


def test_a_checkpoint_without_side_files_finds_its_pipeline_in_the_run_config(base: str, tmp_path: Path) -> None:
    transformer = _load_transformer(base)
    with torch.no_grad():
        next(transformer.parameters()).add_(1.0)
    step = _save(tmp_path / "run", transformer, base, side_files=False)
    merged = DiffusionPipeline.from_pretrained(merge_checkpoint(str(step), str(tmp_path / "merged")))
    want = transformer.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in merged.transformer.state_dict().items())
