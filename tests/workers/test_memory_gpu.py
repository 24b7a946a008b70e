"""The memory lifecycle with the real vLLM engine on a GPU: a wake that fits only because the allocator's cache is
handed back, the same wake failing without it, and a wake that cannot fit stopping with one explained error.

Each scenario runs in a fresh spawned process: an engine started by another test module of this session would still
hold its share of the device."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]
MARGIN = 256 * 2**20


def _scenario(model_dir: str, mode: str) -> str:
    """Start an engine, put it to sleep, fill the device through PyTorch's allocator, then wake it. `mode`:
    ``hand_back`` (the ledger's wake), ``keep`` (waking without handing the cache back), ``live`` (the memory is
    really in use, so nothing can be handed back)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer

    from easyrl.config import EasyRLConfig
    from easyrl.distributed.memory import EngineWakeError, MemoryLedger
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import memory_levers, rollout_spec

    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = cfg.worker.actor.model.tokenizer_path = model_dir
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 8
    cfg.worker.rollout.gpu_memory_utilization = 0.5
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tok.eos_token_id], tok.pad_token_id)
    ledger = MemoryLedger("actor", torch.device("cuda"), memory_levers(cfg))
    ledger.sleep(engine)
    assert ledger.slept_bytes is not None and ledger.slept_bytes > MARGIN
    block = torch.empty(torch.cuda.mem_get_info()[0] - MARGIN, dtype=torch.uint8, device="cuda")
    if mode != "live":
        del block  # like an update's activations: the tensors are gone, the allocator keeps their blocks reserved
    try:
        if mode == "keep":
            engine.wake_up()
        else:
            ledger.wake(engine)
    except EngineWakeError as exc:
        return f"EngineWakeError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "woke"


def _run(model_dir: str, mode: str) -> str:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_scenario, model_dir, mode).result()


def test_wake_fits_because_the_cache_is_handed_back(tiny_model_dir: str) -> None:
    assert _run(tiny_model_dir, "hand_back") == "woke"
    # The control: the very same wake, without handing the cache back, does not fit.
    assert "out of memory" in _run(tiny_model_dir, "keep").lower()


def test_wake_that_cannot_fit_is_explained(tiny_model_dir: str) -> None:
    result = _run(tiny_model_dir, "live")
    assert result.startswith("EngineWakeError: the rollout engine could not wake its weights and KV cache"), result
    for key in ("worker.rollout.gpu_memory_utilization", "worker.actor.offload.offload_params",
                "worker.ref.offload.offload_params", "worker.actor.max_token_len_per_gpu"):  # fmt: skip
        assert key in result
