"""A rollout worker of its own (`easyrl.workers.rollout_role`): a Ray worker group that only generates, fed weights by
the driver, driven by the same rollout loop as the actor's HybridEngine. On CPU: Ray, 2 actor workers over gloo and
2 rollout workers beside them, the HF engine, the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easyrl.config import load_config
from easyrl.rollout import SingleTurnLoop
from easyrl.trainer.plan import plan_of
from easyrl.trainer.role_specs import build_role_specs, rollout_role_spec, sampling_params
from tests.conftest import base_config, left_padded_prompts, write_config


pytestmark = pytest.mark.slow


def test_a_rollout_group_of_its_own_generates_with_the_weights_it_is_given(
    ray_session: None, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    from easyrl.distributed import ResourcePool, WorkerGroup
    from easyrl.workers.actor import ActorWorker
    from easyrl.workers.rollout_role import RolloutRole

    cfg = load_config(write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, tmp_path)), [])
    specs = build_role_specs(cfg, plan_of(cfg), optimizer_steps=1, world_size=2)
    pool = ResourcePool(1, 2, False)
    actor = rollout = None
    try:
        share = {"num_cpus_per_worker": 0.5}
        actor = WorkerGroup(ActorWorker, pool, "actor", specs.actor, **share)
        rollout = WorkerGroup(RolloutRole, pool, "rollout", rollout_role_spec(specs.actor), **share)
        for handle in [actor.call_async("init_model"), rollout.call_async("init_model")]:
            handle.result()
        loop, params = SingleTurnLoop(), sampling_params(cfg, plan_of(cfg)).override({"seed": 11, "n": 2})
        prompts = left_padded_prompts(tiny_model_dir, ["Copy: 1 2 3", "Copy: 0 3", "Copy: 2", "Copy: 3 1 0 2"])

        def tokens(group: WorkerGroup) -> tuple[torch.Tensor, torch.Tensor]:
            rows, timings = loop.run(group, prompts, params)
            assert "timing_s/generate_engine" in timings  # merged over the ranks
            # the actor's engine wakes and sleeps around a session; a rollout worker's is resident
            assert ("timing_s/sleep" in timings) == (group is actor)
            return rows["responses"], rows["policy_version"]

        policy = actor.full_weights()
        want, _ = tokens(actor)
        # Weights it did not load from the checkpoint: another head. The rows change, and carry the given version.
        other = {k: (v.flip(0) if "embed" in k or "lm_head" in k else v) for k, v in policy.items()}
        rollout.receive_weights(other, 7)
        changed, version = tokens(rollout)
        assert version.tolist() == [7] * len(version)
        assert not torch.equal(changed, want)
        # The policy's own weights again: the same rows as the actor's engine, sample for sample.
        rollout.receive_weights(policy, 8)
        same, version = tokens(rollout)
        assert torch.equal(same, want)
        assert version.tolist() == [8] * len(version)
    finally:
        for group in (actor, rollout):
            if group is not None:
                group.shutdown()
        pool.remove()
