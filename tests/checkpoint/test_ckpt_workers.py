"""Worker-side checkpoints through real Ray worker groups and gloo: FSDP2 round trip, resume, merge, world size."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from easyrl.checkpoint import CheckpointManager, CheckpointMixin, is_complete, write_trainer_state
from easyrl.config import EasyRLConfig
from easyrl.distributed import Dispatch, ResourcePool, WorkerError, WorkerGroup, init_distributed, init_ray, register
from easyrl.merge import main as merge_main
from easyrl.workers.model_setup import build_optimizer, build_scheduler, load_model, seed_everything, shard_model


HERE = Path(__file__).resolve().parent


class CkptWorker(CheckpointMixin):
    """Builds the model like ActorWorker.init_model (load -> FSDP2 shard -> AdamW + LR schedule) on CPU."""

    def __init__(self, model_dir: str) -> None:
        torch.set_num_threads(1)
        init_distributed(timeout_s=120)
        seed_everything(7)
        self.cfg = EasyRLConfig()
        mcfg = self.cfg.worker.actor.model
        mcfg.model_path, mcfg.tokenizer_path = model_dir, model_dir
        self.cfg.worker.actor.optim.lr = 1e-2
        self.cfg.worker.actor.optim.lr_warmup_steps = 5
        self.role_name = "actor"
        model = load_model(mcfg, "causal_lm", torch.float32)
        self.model = shard_model(model, self.cfg.worker.actor.fsdp, torch.device("cpu"))
        self.optimizer = build_optimizer(self.model, self.cfg.worker.actor.optim)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.worker.actor.optim, 20)

    @register(dispatch=Dispatch.ALL)
    def train_steps(self, n: int) -> None:
        """`n` optimizer steps on random tokens drawn from the (checkpointed) torch RNG."""
        self.model.train()
        for _ in range(n):
            ids = torch.randint(0, 90, (2, 12))
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        random.random()  # advance the Python and NumPy generators too
        np.random.rand()

    @register(dispatch=Dispatch.ALL)
    def fingerprint(self) -> dict[str, Any]:
        """Local parameter and optimizer shards, scheduler state and RNG states (nothing is advanced)."""
        params = {n: p.to_local().detach().clone() for n, p in self.model.named_parameters()}
        optim = {}
        for n, p in self.model.named_parameters():
            for k, v in self.optimizer.state[p].items():
                optim[f"{n}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        np_state = np.random.get_state()
        return {
            "params": params,
            "optim": optim,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "np_rng": (np_state[1].tolist(), np_state[2:]),
        }

    @register(dispatch=Dispatch.RANK0)
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        with torch.no_grad():
            return self.model(input_ids=ids, use_cache=False).logits


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-for-bit equality of nested fingerprints."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from easyrl.testing.tiny import build_tiny_checkpoint

    # 3 KV heads and an odd intermediate size make some shards uneven over 2 ranks.
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("ckw") / "qwen2",
        arch="qwen2",
        hidden_size=48,
        num_heads=3,
        num_kv_heads=3,
        intermediate_size=75,
    )


@pytest.fixture(scope="module")
def groups(model_dir: str) -> Iterator[dict[int, WorkerGroup]]:
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    started = init_ray(num_cpus=4, env_vars={"PYTHONPATH": pythonpath})
    pools = {2: ResourcePool(1, 2, use_gpu=False), 1: ResourcePool(1, 1, use_gpu=False)}
    made = {w: WorkerGroup(CkptWorker, pools[w], f"actor{w}", model_dir, num_cpus_per_worker=0.5) for w in (2, 1)}
    yield made
    for group in made.values():
        group.shutdown()
    for pool in pools.values():
        pool.remove()
    if started:
        ray.shutdown()


def _save(group: WorkerGroup, root: Path, step: int, model_only: bool = False) -> str:
    manager = CheckpointManager(str(root), save_limit=-1)
    tmp = manager.begin(step)
    group.save_checkpoint(os.path.join(tmp, "actor"), model_only)
    if not model_only:
        write_trainer_state(tmp, {"global_step": step})
    return manager.commit(tmp, step)


@pytest.mark.parametrize("world", [2, 1])
def test_round_trip_resume_and_merge(groups: dict[int, WorkerGroup], world: int, tmp_path: Path) -> None:
    group = groups[world]
    group.train_steps(2)
    folder = _save(group, tmp_path / "run", 2)
    assert is_complete(folder)
    saved = group.fingerprint()

    group.train_steps(3)  # diverge: weights, moments, schedule and RNG all move on
    after_three = group.fingerprint()
    group.load_checkpoint(os.path.join(folder, "actor"))
    assert_same(saved, group.fingerprint())  # bit-for-bit on every rank
    group.train_steps(3)  # resuming replays the same trajectory exactly
    assert_same(after_three, group.fingerprint())

    group.load_checkpoint(os.path.join(folder, "actor"))
    ids = torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = group.logits(ids)
    assert merge_main([folder, "--output", str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    assert (
        AutoTokenizer.from_pretrained(str(tmp_path / "merged")).decode([ord("H"), ord("I")]) == "HI"
    )  # byte-level: id = byte value
    assert (tmp_path / "merged" / "generation_config.json").exists()
    # the default output and --dtype
    assert merge_main([os.path.join(folder, "actor"), "--dtype", "bf16"]) == 0
    half = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "actor", "huggingface_merged"))
    assert half.dtype == torch.bfloat16


def test_other_world_size_is_refused_but_merges(groups: dict[int, WorkerGroup], tmp_path: Path) -> None:
    folder = _save(groups[2], tmp_path, 1)
    with pytest.raises(WorkerError, match="saved by 2 workers but this run has 1"):
        groups[1].load_checkpoint(os.path.join(folder, "actor"))
    model_only = _save(groups[2], tmp_path / "mo", 3, model_only=True)
    assert not os.path.exists(os.path.join(model_only, "actor", "optim_rank0_of2.safetensors"))
    assert merge_main([model_only, "-o", str(tmp_path / "m2")]) == 0
