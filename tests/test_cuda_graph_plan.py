"""The memory plan's estimate of vLLM's CUDA-graph pool (issue 44 item 5): the sizes vLLM 0.32 captures
(`easyrl.rollout.vllm_args.capture_sizes`, a reading of `VllmConfig._set_cudagraph_sizes`), the pool they take
(`easyrl.memory_plan.cuda_graph_bytes`) against the one measured figure, and the update levers reading it."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from easyrl.config.worker import RolloutConfig
from easyrl.memory_plan import (
    RECORDED_GRAPH_GIB,
    GiB,
    ModelShape,
    cuda_graph_bytes,
    engine_capture_sizes,
    plan_lines,
    plan_memory,
)
from easyrl.rollout.vllm_args import capture_sizes
from easyrl.update_levers import choose_levers
from tests.test_memory_plan import _config, _shape


DEFAULT_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
"""vLLM's default list: 1, 2, 4, every 8 below 256, every 16 from 256 to 512 (51 sizes)."""


def test_capture_sizes_follow_vllms_rules() -> None:
    rollout = RolloutConfig()
    assert len(DEFAULT_SIZES) == 51
    # sequences unknown: vLLM's own ceiling, min(2 x its 1,024 offline max_num_seqs, 512)
    assert capture_sizes(rollout, 0, 16384) == DEFAULT_SIZES
    # 1,024 sequences a call: easyrl derives a ceiling of 1,024, every 16 up to it (83 sizes)
    assert capture_sizes(rollout, 1024, 16384) == [*DEFAULT_SIZES, *range(528, 1025, 16)]
    # a scheduler budget under the ceiling cuts it, and the budget itself is captured off the stride
    assert capture_sizes(rollout, 0, 300) == [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]
    # the user's max_num_seqs: vLLM's ceiling 2 x 100 and the decode batch of 100 itself
    small = RolloutConfig(engine_kwargs={"max_num_seqs": 100})
    assert capture_sizes(small, 0, 8192) == sorted([1, 2, 4, *range(8, 201, 8), 100])
    assert capture_sizes(RolloutConfig(engine_kwargs={"cudagraph_capture_sizes": [64, 8, 9000]}), 0, 8192) == [8, 64]
    assert capture_sizes(RolloutConfig(engine_kwargs={"max_cudagraph_capture_size": 16}), 1024, 8192) == [
        1,
        2,
        4,
        8,
        16,
    ]
    assert capture_sizes(RolloutConfig(enforce_eager=True), 1024, 8192) == []
    assert (
        capture_sizes(RolloutConfig(engine_kwargs={"compilation_config": {"cudagraph_mode": "NONE"}}), 0, 8192) == []
    )


def test_graph_pool_at_the_recorded_setting_and_its_growth() -> None:
    """0.5B with vLLM's default 51 sizes: the estimate is the measured 0.49 GiB within the log's rounding (0.05 GiB).
    By hand: the pool of 512 tokens, one layer's working set 512 x (3 x 896 + 2 x 896 + 2 x 128 + 3 x 4864) x 2 +
    each layer's output 24 x 512 x 896 x 2 = 41,811,968, plus 51 sizes x 24 layers x 384 KiB = 481,296,384."""
    small = _shape("0.5b")
    recorded = cuda_graph_bytes(small, DEFAULT_SIZES, 2)
    assert recorded == 41_811_968 + 481_296_384
    assert abs(recorded / GiB - RECORDED_GRAPH_GIB) <= 0.05
    wider = capture_sizes(RolloutConfig(), 1024, 16384)
    assert cuda_graph_bytes(small, wider, 2) > recorded  # more and larger graphs
    assert cuda_graph_bytes(small, [1, 2, 4, 8], 2) < recorded
    assert cuda_graph_bytes(_shape("1.5b"), DEFAULT_SIZES, 2) > recorded  # a wider, deeper model
    wide = ModelShape(**{**small.__dict__, "hidden_size": 2 * small.hidden_size})
    assert cuda_graph_bytes(wide, DEFAULT_SIZES, 2) > recorded  # hidden size alone
    assert cuda_graph_bytes(small, [], 2) == 0


@pytest.mark.parametrize(("batch", "ceiling"), [(32, 512), (256, 1024)])
def test_plan_and_levers_read_the_graphs_of_the_runs_ceiling(batch: int, ceiling: int) -> None:
    """32 prompts x 8 samples stay under vLLM's default ceiling; 256 x 8 on one GPU run 1,024 sequences a step (vLLM's
    offline max_num_seqs), so easyrl captures up to 1,024: the plan's graphs, its KV cache and the update lever's
    figure follow."""
    shape = _shape("1.5b")
    cfg = _config(trainer={"n_gpus_per_node": 1}, data={"rollout_batch_size": batch}, worker={"rollout": {"n": 8}})
    sizes = engine_capture_sizes(cfg)
    assert max(sizes) == ceiling
    plan = plan_memory(shape, cfg, 80 * GiB)
    assert plan.cuda_graphs == cuda_graph_bytes(shape, sizes, 2) and plan.capture_sizes == tuple(sizes)
    graphs = f"CUDA graphs {plan.cuda_graphs / GiB:.1f} for {len(sizes)} batch sizes up to {ceiling} + KV cache"
    assert graphs in "\n".join(plan_lines(plan))  # what `easyrl check` prints
    eager = _config(trainer={"n_gpus_per_node": 1}, data={"rollout_batch_size": batch},
                    worker={"rollout": {"n": 8, "enforce_eager": True}})  # fmt: skip
    assert plan_memory(shape, eager, 80 * GiB).updating == plan.updating - plan.cuda_graphs
    levers = choose_levers(cfg, True, 1, shape, 80 * GiB)
    assert f"the sleeping engine's CUDA graphs {plan.cuda_graphs / GiB:.1f} GiB" in levers.gradient_checkpointing_why


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.parametrize(
    ("engine_kwargs", "sequences", "budget"),
    [({}, 0, 16384), ({}, 1024, 16384), ({}, 0, 300), ({"max_num_seqs": 100}, 0, 8192), ({}, 4000, 2048),
     ({"max_cudagraph_capture_size": 16}, 1024, 8192), ({"cudagraph_capture_sizes": [64, 8, 9000]}, 0, 8192)],
)  # fmt: skip
def test_capture_sizes_are_what_the_installed_vllm_computes(engine_kwargs: dict, sequences: int, budget: int) -> None:
    """The installed vLLM's own `VllmConfig._set_cudagraph_sizes` (0.32: the CPU build's code is the CUDA build's) run
    on the engine's settings as easyrl passes them (the derived ceiling, the user's keys) gives the same list."""
    from vllm.config import CompilationConfig, VllmConfig

    from easyrl.rollout.vllm_args import VLLM_OFFLINE_MAX_SEQS, generation_args

    rollout = RolloutConfig(engine_kwargs=engine_kwargs)
    derived = {a.name: a.value for a in generation_args(rollout, sequences, on_cuda=True) if a.value is not None}
    passed = {k: v for k, v in (derived | engine_kwargs).items() if "cudagraph" in k}
    compilation = CompilationConfig(**passed)
    engine = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=compilation,
        uniform_decode_query_len=1,  # no speculative decoding
        scheduler_config=SimpleNamespace(
            max_num_seqs=engine_kwargs.get("max_num_seqs", VLLM_OFFLINE_MAX_SEQS), max_num_batched_tokens=budget
        ),
        performance_mode="balanced",
        speculative_config=None,
    )
    VllmConfig._set_cudagraph_sizes(engine)  # type: ignore[arg-type]
    assert capture_sizes(rollout, sequences, budget) == compilation.cudagraph_capture_sizes
