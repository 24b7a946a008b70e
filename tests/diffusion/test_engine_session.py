"""The diffusers engine driven by the same `RolloutWorker` the actor hosts for text engines: built from the registry
by name (`worker.rollout.name: diffusers`), sleeping between sessions, taking pushed weights, its rows stamped with
the policy version that sampled them."""

from __future__ import annotations

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.diffusion.engine import DiffusionRolloutEngine
from easyrl.diffusion.tiny import build_tiny_sd3_pipeline
from easyrl.distributed.memory import MemoryLedger
from easyrl.rollout.engine import SamplingParams
from easyrl.rollout.worker import RolloutWorker
from easyrl.seeding import SEED_COLUMN, prompt_seeds
from easyrl.trainer.plan import plan_of
from easyrl.trainer.role_specs import rollout_spec
from easyrl.workers.rollout_role import ReceivedWeights


PARAMS = SamplingParams(n=2)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> RolloutWorker:
    pipe = build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0)
    cfg = EasyRLConfig()
    # the pipeline's own (CLIP) tokenizer stands where an LLM's would: the data section tokenizes prompts with it
    cfg.worker.actor.model.model_path, cfg.worker.actor.model.tokenizer_path = pipe, f"{pipe}/tokenizer"
    cfg.worker.rollout.name = "diffusers"
    diffusion = cfg.worker.rollout.diffusion
    diffusion.num_steps, diffusion.height, diffusion.width, diffusion.max_sequence_length = 2, 32, 32, 8
    plan = plan_of(cfg)
    assert plan.modality == "diffusion"  # detected from the folder's model_index.json (enable: null)
    device = torch.device("cpu")
    return RolloutWorker(rollout_spec(cfg, plan), device, MemoryLedger("actor", device))


def prompts() -> Batch:
    return Batch({SEED_COLUMN: prompt_seeds(4, 2, PARAMS.n)}, {"raw_prompt": ["a red image", "a blue image"]})


def test_sessions_sample_push_weights_and_stamp_the_policy_version(worker: RolloutWorker) -> None:
    assert isinstance(worker.engine, DiffusionRolloutEngine)
    worker.open(ReceivedWeights({}, merged_lora=False), 0, make_room=lambda: None)
    first = worker.generate(prompts(), PARAMS)
    worker.close()
    assert first["latents"].shape[:2] == (4, 3) and first["policy_version"].tolist() == [0] * 4
    assert (first["token_policy_version"] == 0).all()  # every trained step of version 0
    transformer = worker.engine.pipeline.transformer
    moved = {name: p.detach() * 0.5 for name, p in transformer.named_parameters()}
    worker.stale = True
    worker.open(ReceivedWeights(moved, merged_lora=False), 1, make_room=lambda: None)
    second = worker.generate(prompts(), PARAMS)
    worker.close()
    assert second["policy_version"].tolist() == [1] * 4
    assert torch.equal(first["latents"][:, 0], second["latents"][:, 0])  # the same seeds: the same starting noise
    assert not torch.equal(first["latents"][:, -1], second["latents"][:, -1])  # other weights: other images
