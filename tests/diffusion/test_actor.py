"""`easyrl.diffusion.actor`: one Flow-GRPO update of the tiny SD3 transformer gives the same weights and loss
figures at 1 rank and at 2 ranks (FSDP2 over gloo, different micro-batches); under LoRA only the adapters train and
the reference (adapters off) gives the base model's log-probs; an adapters-only checkpoint restores the trained
policy in a fresh worker."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import SD3Transformer2DModel

from easyrl.batch import Batch
from easyrl.diffusion.policy import transition_log_probs
from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from tests.conftest import ppo_kl_loss
from tests.diffusion.trajectories import sample_trajectories, text_features
from tests.workers.test_batching import init_rank, run_ranks


ROWS, STEPS, GUIDANCE, NOISE = 4, 4, 2.0, 0.7


def _spec(pipe: str, world: int, micro: int, lora: int) -> Any:
    from easyrl.config import FSDPConfig, ModelConfig, OptimConfig
    from easyrl.config.worker import LoraConfig
    from easyrl.diffusion.actor import DenoiserActorSpec, SamplerSettings
    from easyrl.workers.specs import ModelSpec, ProcessSpec, UpdateSpec

    model = ModelConfig(model_path=pipe, lora=LoraConfig(rank=lora, alpha=2 * lora))
    return DenoiserActorSpec(
        process=ProcessSpec(seed=0),
        model=ModelSpec(model, fsdp=FSDPConfig(), optim=OptimConfig(lr=1e-2, weight_decay=0.0)),
        update=UpdateSpec(ROWS // world, micro, epochs=1, max_grad_norm=1.0, loss_avg_mode="token-mean"),
        loss=ppo_kl_loss(),
        sampler=SamplerSettings(GUIDANCE, NOISE),
        micro_batch_size_for_experience=micro,
        serves_reference=lora > 0,
    )


def _worker(rank: int, world: int, pipe: str, batch: Batch, micro: int, lora: int, out: str) -> None:
    from easyrl.diffusion.actor import DenoiserActorWorker

    init_rank(rank, world)
    worker = DenoiserActorWorker(_spec(pipe, world, micro, lora))
    worker.init_model()
    if not lora:
        # SGD with lr 1: Adam's first step is ~lr * sign(grad), which hides the gradients the layouts must agree on
        # (and turns float-order noise in near-zero ones into whole steps).
        params = [p for p in worker.model.parameters() if p.requires_grad]
        worker.trainable.optimizer = worker.optimizer = torch.optim.SGD(params, lr=1.0)
        worker.trainable.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
    mine = batch.chunk(world)[rank]
    result: dict[str, Any] = {}
    if lora:
        result["trainable"] = sorted(n for n, p in worker.model.named_parameters() if p.requires_grad)
    result["metrics"] = worker.update_actor(mine, 0.0)
    result["weights"] = worker.full_weights()
    if lora:  # after the update: the reference must still be the base, the policy not
        # the tensors alone: the parent loads the result with weights_only=True, which holds no easyrl classes
        result["ref"] = worker.compute_ref_log_probs(mine.select(*_SCORED)).tensors
        result["old"] = worker.compute_log_probs(mine.select(*_SCORED)).tensors
    folder = str(Path(out).parent / f"ckpt{world}_{lora}")
    worker.save_checkpoint(folder)
    if lora:  # a fresh worker restores the trained adapters from the (adapters-only) checkpoint
        fresh = DenoiserActorWorker(_spec(pipe, world, micro, lora))
        fresh.init_model()
        fresh.load_checkpoint(folder)
        result["restored"] = fresh.full_weights()
    if not lora:  # the same rank processes go on to the float64 AdamW run (one spawn per layout for both tests)
        result["adamw64"] = _adamw_updates(pipe, world, micro, mine)
    if rank == 0:
        torch.save(result, out)


def _adamw_updates(pipe: str, world: int, micro: int, mine: Batch) -> list[dict[str, torch.Tensor]]:
    """Two updates with the spec's own AdamW, the denoiser in float64: the full weights after each."""
    from easyrl.diffusion.actor import DenoiserActorWorker
    from easyrl.models.dtypes import DTYPES

    # Configs name no float64 (no run wants it); this rank process lets the loader take it for the measurement.
    DTYPES.setdefault("fp64", torch.float64)
    spec = _spec(pipe, world, micro, 0)
    worker = DenoiserActorWorker(dataclasses.replace(spec, model=dataclasses.replace(spec.model, torch_dtype="fp64")))
    worker.init_model()
    weights = []
    for _ in range(2):
        worker.update_actor(mine, 0.0)
        weights.append(worker.full_weights())
    return weights


_SCORED = (
    "latents", "sigmas", "timesteps", "prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
    "negative_pooled_prompt_embeds", "loss_mask",
)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Batch, SD3Transformer2DModel]:
    pipe = build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0)
    base = SD3Transformer2DModel.from_pretrained(pipe, subfolder="transformer").eval()
    fields = sample_trajectories(
        base, text_features(base, ROWS, seed=1), num_steps=STEPS, guidance_scale=GUIDANCE, noise_level=NOISE, seed=2,
        fraction=0.5,
    )  # fmt: skip
    mask = fields["response_mask"]
    with torch.no_grad():
        ref = transition_log_probs(base, fields, GUIDANCE, NOISE, mask)
    gen = torch.Generator().manual_seed(3)
    fields |= {
        "old_log_probs": fields["rollout_log_probs"] * mask,
        "ref_log_probs": ref.log_probs,
        "ref_means": ref.means,
        "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, STEPS) * mask,
    }
    return pipe, Batch(fields), base


def _run(tmp_path: Path, pipe: str, batch: Batch, world: int, micro: int, lora: int = 0) -> dict[str, Any]:
    out = tmp_path / f"out{world}_{lora}.pt"
    run_ranks(_worker, world, pipe, batch, micro, lora, str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, setup: Any) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """1 rank with 2 micro-batches and 2 ranks with 1 each: the SGD update and the float64 AdamW updates (and the
    folder holding their checkpoints)."""
    pipe, batch, _ = setup
    tmp = tmp_path_factory.mktemp("layouts")
    return _run(tmp, pipe, batch, 1, 2), _run(tmp, pipe, batch, 2, 1), tmp


def test_one_update_is_the_same_at_one_and_two_ranks(setup: Any, layouts: Any) -> None:
    _, _, base = setup
    one, two, tmp_path = layouts
    params = {n for n, _ in base.named_parameters()}  # buffers (SD3's fixed sin-cos positions) are not streamed
    assert one["weights"].keys() == two["weights"].keys() == params
    for name, value in one["weights"].items():
        assert torch.allclose(value, two["weights"][name], atol=1e-6, rtol=1e-5), name
    changed = [n for n, v in one["weights"].items() if not torch.equal(v, base.state_dict()[n])]
    assert len(changed) > len(one["weights"]) // 2  # a full fine-tune moves (nearly) every tensor
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-7), key
    assert one["metrics"]["actor/grad_norm"] > 0
    # The checkpoint's transformer config names the model class, not FSDP's wrapper.
    assert (
        '"_class_name": "SD3Transformer2DModel"' in (tmp_path / "ckpt1_0" / "huggingface" / "config.json").read_text()
    )


def test_two_adamw_updates_in_float64_are_the_same_at_one_and_two_ranks(setup: Any, layouts: Any) -> None:
    """AdamW, as configured: its first step is ~lr * g / (|g| + eps) per entry, so in float32 an entry whose gradient
    is float-order noise (the two layouts sum their micro-batches and ranks in different orders) moves by a share of
    lr in either direction, and the layouts' weights differ by up to ~1e-5 here (1e-5 of the update), more in a
    longer run. In float64 that noise is ~1e-16 and the two layouts agree to ~1e-14 after two steps: nothing in the
    update (loss weights, clipping, timestep masks) depends on the layout; the float32 gap is Adam amplifying
    rounding, not a different update."""
    _, _, base = setup
    base_sd = base.state_dict()
    for one, two in zip(layouts[0]["adamw64"], layouts[1]["adamw64"]):
        assert one.keys() == two.keys()
        gap = max(float((one[k] - two[k]).abs().max()) for k in one)
        moved = sum(float((one[k].double() - base_sd[k].double()).square().sum()) for k in one) ** 0.5
        assert one[next(iter(one))].dtype == torch.float64 and moved > 1.0 and gap < 1e-11, (gap, moved)


def test_lora_trains_only_adapters_and_its_reference_is_the_base(tmp_path: Path, setup: Any) -> None:
    pipe, batch, base = setup
    out = _run(tmp_path, pipe, batch, 1, 2, lora=4)
    assert out["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in out["trainable"])
    weights, base_sd = out["weights"], base.state_dict()
    assert weights.keys() == {n for n, _ in base.named_parameters()}  # merged, under the base model's names
    adapted = {n.split(".lora_")[0] + ".weight" for n in out["trainable"]}
    assert any(not torch.equal(weights[n], base_sd[n]) for n in adapted)
    assert all(torch.equal(weights[n], base_sd[n]) for n in weights if n not in adapted)
    assert all(torch.equal(out["restored"][n], w) for n, w in weights.items())
    mask = batch["response_mask"] > 0
    assert torch.allclose(out["ref"]["ref_log_probs"][mask], batch["ref_log_probs"][mask], atol=1e-5)
    assert torch.allclose(out["ref"]["ref_means"], batch["ref_means"], atol=1e-5)
    assert not torch.allclose(out["old"]["old_log_probs"][mask], batch["ref_log_probs"][mask], atol=1e-5)


def test_lora_targets_are_checked_on_the_denoiser_before_any_worker_starts(setup: Any) -> None:
    """The driver's check builds the pipeline's transformer on the meta device (the LLM check reads a transformers
    config a pipeline folder does not have), also after diffusers' AutoModel loaded that folder (which leaves
    AutoModel pointed at model_index.json), and names the denoiser's linear layers when the targets match none."""
    from diffusers import AutoModel

    from easyrl.config import ConfigError, ModelConfig
    from easyrl.config.worker import LoraConfig
    from easyrl.diffusion.actor import check_lora_targets

    pipe = setup[0]
    AutoModel.from_pretrained(pipe, subfolder="transformer")
    check_lora_targets(ModelConfig(model_path=pipe, lora=LoraConfig(rank=4, alpha=8)))
    bad = ModelConfig(model_path=pipe, lora=LoraConfig(rank=4, alpha=8, target_modules="q_proj"))
    with pytest.raises(ConfigError, match=r"^worker\.actor\.model\.lora\.target_modules: 'q_proj' .*to_q"):
        check_lora_targets(bad)
