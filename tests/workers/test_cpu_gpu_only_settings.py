"""GPU-only settings on a CPU run: FSDP CPU offload and the params/optimizer offload are no-ops, not a crash."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from easyrl.workers.forward_backward import token_log_probs
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_packing import make_batch


CPU = torch.device("cpu")


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:

    from easyrl.config import FSDPConfig, ModelConfig, OffloadConfig, OptimConfig
    from easyrl.workers.specs import ModelSpec
    from easyrl.workers.trainable import TrainableModel

    init_rank(rank, world)
    mb = make_batch(b=2, seed=3, vocab=90)
    res = {}
    for key, offload in (("plain", False), ("offload", True)):
        torch.manual_seed(0)
        spec = ModelSpec(
            model=ModelConfig(model_path=model_dir, enable_gradient_checkpointing=False),
            fsdp=FSDPConfig(enable_cpu_offload=offload),
            optim=OptimConfig(lr=1e-3),
            offload=OffloadConfig(offload_params=offload, offload_optimizer=offload),
        )
        trainable = TrainableModel(spec, CPU)
        assert trainable.optimizer is not None
        with trainable.resident():
            lp, _ = token_log_probs(trainable.module, mb, CPU, 1.0, with_entropy=False)
            (lp * mb["response_mask"]).sum().backward()
            trainable.optimizer.step()
        res[key] = lp.detach().tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    close_rank()


def test_fsdp_cpu_offload_is_a_noop_on_cpu(tmp_path: Path, tiny_model_dir: str) -> None:
    """EasyR1's reference default `fsdp.enable_cpu_offload: true` crashed a CPU run ("Cannot access accelerator
    device when none is available"); on CPU it now shards and runs exactly like the plain model."""
    out = tmp_path / "res.json"
    run_ranks(_worker, 2, tiny_model_dir, str(out))
    res = json.loads(out.read_text())
    torch.testing.assert_close(torch.tensor(res["offload"]), torch.tensor(res["plain"]), atol=0, rtol=0)


def test_cpu_run_warns_once_naming_each_gpu_only_setting(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    from easyrl.check import cpu_noop_settings, cpu_noop_warning
    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    path = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    assert cpu_noop_settings(load_config(path)) == []
    assert cpu_noop_warning(load_config(path)) is None
    gpu_only = [
        "worker.actor.offload.offload_params=true",
        "worker.actor.offload.offload_optimizer=true",
        "worker.ref.fsdp.enable_cpu_offload=true",
        "worker.rollout.enforce_eager=true",
        "worker.rollout.gpu_memory_utilization=0.8",
    ]
    cfg = load_config(path, gpu_only)
    assert cpu_noop_settings(cfg) == gpu_only
    warning = cpu_noop_warning(cfg)
    assert warning is not None and warning.startswith("running on CPU: GPU-only settings have no effect")
    assert "\n" not in warning and all(item in warning for item in gpu_only)
    assert cpu_noop_warning(load_config(path, [*gpu_only, "trainer.device=cuda"])) is None
