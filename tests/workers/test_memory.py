"""The memory plan's arithmetic against hand-computed figures, the wake error's text, and the ledger's keys."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config

from easyrl.config import EasyRLConfig
from easyrl.distributed.memory import (
    MemoryLedger,
    is_out_of_memory,
    memory_keys,
    release_cached_memory,
    wake_error_message,
)
from easyrl.memory_plan import GiB, ModelShape, plan_fixes, plan_lines, plan_memory, plan_problems
from easyrl.trainer.role_specs import memory_levers


# Public Qwen2.5 configs (config.json on the hub).
QWEN25_1_5B = Qwen2Config(
    vocab_size=151936,
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    tie_word_embeddings=True,
)
QWEN25_0_5B = Qwen2Config(
    vocab_size=151936,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
)


def test_parameter_count_matches_the_published_models() -> None:
    """Qwen2.5-1.5B has 1,543,714,304 parameters and 0.5B 494,032,768 (their safetensors, tied head)."""
    # 1.5B, per layer: q 1536*1536 + k, v 1536*256 each + o 1536*1536 + biases 1536+256+256 = 5,507,072;
    # MLP 3*1536*8960 = 41,287,680; norms 2*1536 -> 46,797,824; x28 = 1,310,339,072; + embedding 151936*1536 =
    # 233,373,696 + final norm 1536.
    assert ModelShape.from_hf_config(QWEN25_1_5B).parameter_count() == 1_543_714_304
    assert ModelShape.from_hf_config(QWEN25_0_5B).parameter_count() == 494_032_768
    untied = Qwen2Config(**{**QWEN25_0_5B.to_dict(), "tie_word_embeddings": False})
    assert ModelShape.from_hf_config(untied).parameter_count() == 494_032_768 + 151936 * 896


def _config(**worker: object) -> EasyRLConfig:
    base = OmegaConf.structured(EasyRLConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create(worker)))  # type: ignore[return-value]


def test_memory_plan_of_qwen25_1_5b_over_two_ranks() -> None:
    """The defaults (fp32 master weights, adamw, dynamic batching at 16384 tokens, fused head, gradient
    checkpointing, a reference model, vLLM in bf16 at 0.6 of an 80 GiB device), sharded over 2 ranks."""
    cfg = _config(trainer={"n_gpus_per_node": 2}, algorithm={"disable_kl": False})
    plan = plan_memory(ModelShape.from_hf_config(QWEN25_1_5B), cfg, 80 * GiB)
    # 1,543,714,304 / 2 = 771,857,152 parameters per rank.
    assert plan.actor.weights == 771_857_152 * 4 == 3_087_428_608
    assert plan.actor.grads == 3_087_428_608
    assert plan.actor.optimizer == 771_857_152 * 8 == 6_174_857_216  # two fp32 moments
    # 28 layers x 16384 tokens x 1536 x 2 bytes = 1,409,286,144 (checkpointed layer inputs);
    # one layer's working set 16384 x (3*1536 + 2*1536 + 2*256 + 3*8960) x 2 = 1,149,239,296;
    # fused head: 1024 tokens x 151936 x 8 = 1,244,659,712, its weight gradient in bf16 151936 x 1536 x 2 =
    # 466,747,392 (written block by block of columns), and over those 16 blocks the hidden states' gradient summed in
    # fp32 with one block's bf16 product, 16384 x 1536 x (4 + 2) = 150,994,944.
    assert plan.actor.activations == 1_409_286_144 + 1_149_239_296 + 1_244_659_712 + 466_747_392 + 150_994_944
    assert plan.ref_weights == 3_087_428_608
    assert plan.engine == int(0.6 * 80 * GiB) == 51_539_607_552
    assert plan.engine_weights == 1_543_714_304 * 2
    # KV per token: 2 (k, v) x 28 layers x 2 heads x 128 x 2 bytes = 28,672; vLLM takes its CUDA graphs out of the
    # same budget: 256 sequences a call leave vLLM's default 51 sizes up to 512, whose pool is one layer's working
    # set 512 x 35,072 x 2 = 35,913,728 + each layer's output 28 x 512 x 1536 x 2 = 44,040,192, plus 51 x 28 x 384 KiB
    # = 561,512,448 of per-graph overhead (easyrl.memory_plan.cuda_graph_bytes).
    graphs = 35_913_728 + 44_040_192 + 561_512_448
    assert plan.cuda_graphs == graphs == 641_466_368
    assert plan.kv_cache_tokens == (51_539_607_552 - 3_087_428_608 - graphs) // 28_672 == 1_667_505
    # Two processes (actor with the engine, reference), each a CUDA context (0.5 GiB) and NCCL buffers (256 MiB,
    # two ranks).
    assert plan.per_process == 2 * (GiB // 2 + 256 * 2**20) == 1_610_612_736
    # Generating: engine + actor weights + optimizer + reference weights (nothing offloaded) + the processes.
    assert plan.generating == 51_539_607_552 + 3_087_428_608 + 6_174_857_216 + 3_087_428_608 + 1_610_612_736
    # Updating: the actor's whole state and activations + the reference's weights + the engine's CUDA graphs (they
    # stay through sleep) + the processes.
    activations = 3_803_185_152 + 466_747_392 + 150_994_944  # the layers' and the head's chunk, the head's gradients
    # FSDP2's bf16 gathered copies at the head's backward: the root unit (the tied embedding 151936 x 1536 and the
    # final norm 1536 = 233,375,232) and two decoder layers ((1,543,714,304 - 233,375,232) / 28 = 46,797,824 each)
    assert plan.actor.gathered == (233_375_232 + 2 * 46_797_824) * 2 == 653_941_760
    updating = 2 * 3_087_428_608 + 6_174_857_216 + activations + 653_941_760 + 3_087_428_608 + graphs + 1_610_612_736
    assert plan.updating == updating
    # Sleep level 2 by default (full weight sync): nothing pinned on the host.
    assert plan.pinned_host == 0
    assert plan_problems(plan) == []
    lines = "\n".join(plan_lines(plan))
    assert "1.54B parameters" in lines and "about 1667505 tokens" in lines


def test_memory_plan_of_the_hf_engine_counts_its_weights_and_one_calls_cache() -> None:
    """The HF engine reserves no budget (`EngineCapabilities.reserves_budget`): it holds its weights, and while a call
    runs that call's KV cache at full length and a step's logits; `gpu_memory_utilization` does not size it. 1.5B on 2
    ranks: 512 prompts x 5 samples / 2 engines = 1,280 rows of 1024 + 1024 tokens."""
    cfg = _config(trainer={"n_gpus_per_node": 2}, worker={"rollout": {"name": "hf", "n": 5}},
                  data={"rollout_batch_size": 512, "max_prompt_length": 1024, "max_response_length": 1024})  # fmt: skip
    shape = ModelShape.from_hf_config(QWEN25_1_5B)
    plan = plan_memory(shape, cfg, 80 * GiB)
    assert plan.engine_rows == 1280 and plan.kv_cache_tokens == 1280 * 2048 and plan.cuda_graphs == 0
    # bf16 weights, unsplit; 28,672 bytes of K and V a token (2 x 28 layers x 2 heads x 128 x 2); logits 3 x 4 bytes
    assert plan.engine == 1_543_714_304 * 2 + 1280 * 2048 * 28_672 + 3 * 1280 * 151936 * 4
    assert plan.updating - plan.actor.total - plan.ref_weights - plan.per_process == plan.engine_weights
    assert (
        plan.generating - plan.engine
        == plan.actor.weights + plan.actor.optimizer + plan.ref_weights + plan.per_process
    )
    lines = "\n".join(plan_lines(plan))
    assert "one call's 1280 rows at full length, 2621440 tokens" in lines and "(the engine's weights stay)" in lines
    # one call of 2.6M tokens does not fit beside the training state: the fix is fewer or shorter rows
    problems = plan_problems(plan)
    assert (
        len(problems) == 1 and "fewer rows per engine call (data.rollout_batch_size, worker.rollout.n)" in problems[0]
    )
    assert "gpu_memory_utilization" not in problems[0]
    assert plan_fixes(shape, cfg, 80 * GiB) and not any("utilization" in f for f in plan_fixes(shape, cfg, 80 * GiB))


def test_memory_plan_levers_and_problems() -> None:
    """adamw_bf16 halves what fp32 moments take, offload keeps the state off the GPU while generating, and a plan that
    cannot fit names the keys that fix it."""
    shape = ModelShape.from_hf_config(QWEN25_1_5B)
    cfg = _config(
        worker={
            "actor": {"optim": {"strategy": "adamw_bf16"}, "offload": {"offload_params": True}},
            "rollout": {"gpu_memory_utilization": 0.9},
        },
        algorithm={"disable_kl": False},
        trainer={"n_gpus_per_node": 1},
    )
    plan = plan_memory(shape, cfg, 24 * GiB)
    assert plan.actor.optimizer == 1_543_714_304 * 4  # two bf16 moments, one rank
    # one rank, two processes: their CUDA contexts and no NCCL buffers
    assert plan.generating == int(0.9 * 24 * GiB) + plan.actor.optimizer + plan.ref_weights + 2 * (GiB // 2)
    problems = "\n".join(plan_problems(plan))
    assert "generating needs" in problems and "worker.rollout.gpu_memory_utilization" in problems
    assert "the update needs" in problems and "worker.actor.max_token_len_per_gpu" in problems
    tiny_engine = plan_memory(
        shape, _config(worker={"rollout": {"gpu_memory_utilization": 0.05}}, trainer={"n_gpus_per_node": 1}), 24 * GiB
    )
    assert "leave no KV cache" in "\n".join(plan_problems(tiny_engine))


def test_allocation_failures_are_recognised() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # vLLM's cumem allocator (sleep mode) raises a plain RuntimeError.
    assert is_out_of_memory(RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_wake_error_names_the_figures_and_real_keys() -> None:
    cfg = _config()
    text = wake_error_message(
        ["kv_cache"],
        free_bytes=3 * GiB,
        total_bytes=80 * GiB,
        slept_bytes=48 * GiB,
        weights_bytes=3 * GiB,
        held_bytes=20 * GiB,
        levers=memory_levers(cfg),
        reason="CUDA Error: out of memory at cumem_allocator.cpp:163",
    )
    assert "could not wake its KV cache" in text
    assert "3.00 GiB free of the device's 80.00 GiB" in text
    assert "KV cache needs about 45.00 GiB" in text and "held 20.00 GiB" in text
    assert text.endswith("The allocator said: CUDA Error: out of memory at cumem_allocator.cpp:163")
    keys = set(re.findall(r"worker\.[a-z_.]+[a-z]", text))
    assert keys == {
        "worker.rollout.gpu_memory_utilization",
        "worker.actor.offload.offload_params",
        "worker.actor.offload.offload_optimizer",
        "worker.ref.offload.offload_params",
        "worker.actor.max_token_len_per_gpu",
    }
    for key in keys:  # every key it names is a real config key
        assert OmegaConf.select(OmegaConf.structured(EasyRLConfig), key, throw_on_missing=True) is not None
    # The engine's own pool is part of what the allocator holds (also asleep): the message takes it out.
    apart = wake_error_message(
        ["kv_cache"], 3 * GiB, 80 * GiB, 48 * GiB, 3 * GiB, 60 * GiB, memory_levers(cfg), "oom", engine_bytes=48 * GiB
    )
    assert (
        "the actor's training state held 12.00 GiB (its allocator's 60.00 GiB less the engine's own 48.00 GiB" in apart
    )
    unmeasured = wake_error_message(None, None, None, None, None, None, memory_levers(cfg), "out of memory")
    assert "weights and KV cache need about not measured" in unmeasured


def test_ledger_keys_and_order_on_cpu() -> None:
    """On CPU the ledger measures this process's RSS: a boundary is logged as its GiB, a peak as the peak RSS of the
    phase; every mark and release is recorded in order."""
    ledger = MemoryLedger("actor", torch.device("cpu"))
    ledger.mark("after_generate")
    with ledger.peak("update"):
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched inside the phase
        del block
    ledger.release("before_wake")
    assert list(ledger.events) == ["after_generate", "start:update", "end:update", "release:before_wake"]
    metrics = ledger.drain()
    assert set(metrics) == {"perf/mem/actor/after_generate_gb", "perf/mem/actor/peak_update_gb"}
    assert metrics["perf/mem/actor/peak_update_gb"] >= 64 / 1024
    assert ledger.drain() == {}  # drained
    assert set(memory_keys("actor")) >= set(metrics)
    assert memory_keys("ref") == ["perf/mem/ref/peak_ref_gb"]
    release_cached_memory(torch.device("cpu"))  # no CUDA: only the garbage collector


@pytest.mark.gpu
def test_cuda_ledger_keeps_the_engine_pool_apart() -> None:
    """What is allocated while the engine is built (here: 2 GiB kept alive, as vLLM keeps its pools) is the engine's:
    logged as engine_gb, and not in the training peaks or the allocator figures."""
    ledger = MemoryLedger("actor", torch.device("cuda"))
    with ledger.building_engine():
        engine_pool = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    assert ledger.engine_reserved >= 2 * GiB
    with ledger.peak("update"):
        block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        del block
    metrics = ledger.drain()
    assert 1.0 <= metrics["perf/mem/actor/peak_update_gb"] < 1.5  # the update's 1 GiB, not the engine's 2
    assert 2.0 <= metrics["perf/mem/actor/engine_gb"] < 2.5
    stats = ledger.allocator_stats()
    assert stats["perf/memory_allocated_gb"] < 0.5 and stats["perf/device_total_gb"] > 2
    del engine_pool


@pytest.mark.gpu
def test_cuda_ledger_reports_device_figures() -> None:
    ledger = MemoryLedger("ref", torch.device("cuda"))
    with ledger.peak("ref"):
        block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        del block
    metrics = ledger.drain()
    assert metrics["perf/mem/ref/peak_ref_gb"] >= 1.0  # the allocator reserved the block during the phase
    ledger.release("after_ref")
    assert torch.cuda.memory_reserved() < GiB  # handed back
