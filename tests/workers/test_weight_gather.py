"""The weight stream (`iter_full_weights`) gathers FSDP2 shards a bucket at a time: the same names, order and bits as
one `full_tensor()` per parameter, at any bucket budget, with one all-gather per bucket. FSDP2 over gloo, 2 ranks, a
tiny tied Qwen2 with an odd vocabulary, plus parameters of 5 rows (3 + 2), 1 row (1 + 0), in bf16 and unsharded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.workers.test_batching import close_rank, init_rank, run_ranks


CPU = torch.device("cpu")
WORLD = 2
VOCAB = 273
"""Odd: the embedding's 273 rows shard 137 + 136."""
BUDGETS = {"default": None, "small": 4096, "tiny": 1}
"""Bucket budgets in bytes (None: the module's own); at 1 byte every parameter is over budget, a bucket of its own."""
SHARDED = 29
"""DTensor parameters: the 26 of the 2-layer model and `odd`, `one`, `bf16`."""
DEFAULT_BUCKETS = 4
"""At the default budget: fp32 up to `mlp.one`; `mlp.plain` is no DTensor; fp32 to layer 1; `bf16`; fp32."""


def _model(model_dir: str) -> nn.Module:
    from easyrl.config import FSDPConfig, ModelConfig
    from easyrl.workers.model_setup import load_model, shard_model

    model = load_model(ModelConfig(model_path=model_dir))
    layers: Any = model.model.layers
    torch.manual_seed(1)  # the same extra parameters on both ranks before they are sharded
    layers[0].mlp.odd = nn.Parameter(torch.randn(5, 3))  # rows 3 + 2
    layers[0].mlp.one = nn.Parameter(torch.randn(1, 4))  # rows 1 + 0
    layers[1].bf16 = nn.Parameter(torch.randn(3, 8).to(torch.bfloat16))  # another dtype: its own bucket
    model = shard_model(model, FSDPConfig(), CPU)
    layers[0].mlp.plain = nn.Parameter(torch.randn(2, 2))  # registered after sharding: a plain tensor between shards
    return model


def _per_parameter(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as it was: one `full_tensor()` per parameter, tied names after their first one."""
    from easyrl.workers.model_setup import full_tensor, tied_names

    names = tied_names(model)
    for name, param in model.named_parameters():
        full = full_tensor(param)
        yield name, full
        for alias in names.get(name, ()):
            yield alias, full


def _count_collectives(calls: dict[str, int]) -> None:
    """Count (and still run) every all-gather: the bucketed one and DTensor's own per-parameter one."""
    from torch.distributed.tensor import DTensor

    from easyrl.workers import model_setup

    all_gather, full_tensor = model_setup._all_gather_single, DTensor.full_tensor

    def counted_all_gather(*args: Any, **kwargs: Any) -> Any:
        calls["all_gather_single"] += 1
        return all_gather(*args, **kwargs)

    def counted_full_tensor(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["full_tensor"] += 1
        return full_tensor(self, *args, **kwargs)

    model_setup._all_gather_single = counted_all_gather
    DTensor.full_tensor = counted_full_tensor  # type: ignore[method-assign]


def _gather_worker(rank: int, world: int, model_dir: str, out: str) -> None:

    from easyrl.workers import model_setup

    init_rank(rank, world)
    model = _model(model_dir)
    expected = list(_per_parameter(model))
    calls = {"all_gather_single": 0, "full_tensor": 0}
    _count_collectives(calls)
    default = model_setup.GATHER_BUCKET_BYTES
    results: dict[str, Any] = {"expected": [name for name, _ in expected]}
    for label, budget in BUDGETS.items():
        model_setup.GATHER_BUCKET_BYTES = default if budget is None else budget
        calls.update(all_gather_single=0, full_tensor=0)
        got = [(name, full, full.requires_grad) for name, full in model_setup.iter_full_weights(model, aliases=True)]
        results[label] = {
            "names": [name for name, _, _ in got],
            # bit-exact: same dtype, shape and every bit (torch.equal compares values, the dtype check the rest)
            "mismatches": [
                name
                for (name, full, _), (_, want) in zip(got, expected, strict=False)
                if full.dtype != want.dtype or not torch.equal(full, want)
            ],
            "requires_grad": [name for name, _, grad in got if grad],
            "calls": dict(calls),
        }
    model_setup.GATHER_BUCKET_BYTES = default
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    close_rank()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's stream at each budget, against its own per-parameter stream."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("gather")
    model_dir = build_tiny_checkpoint(root / "qwen2", num_heads=2, num_kv_heads=1, vocab_size=VOCAB)
    run_ranks(_gather_worker, WORLD, model_dir, str(root))
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _assert_identical(result: dict[str, Any], expected: list[str]) -> None:
    assert result["names"] == expected
    assert result["mismatches"] == []
    assert result["requires_grad"] == []


def test_bucketed_stream_equals_per_parameter_full_tensor(gathered: list[dict[str, Any]]) -> None:
    for result in gathered:
        expected = result["expected"]
        # the cases this model is built to hold, in named_parameters order, the tied head right after the embedding
        assert expected[:2] == ["model.embed_tokens.weight", "lm_head.weight"]
        assert {"model.layers.0.mlp.odd", "model.layers.0.mlp.one", "model.layers.0.mlp.plain"} <= set(expected)
        assert "model.layers.1.bf16" in expected
        _assert_identical(result["default"], expected)


@pytest.mark.parametrize("budget", ["small", "tiny"])
def test_small_budgets_give_the_same_stream(gathered: list[dict[str, Any]], budget: str) -> None:
    for result in gathered:
        _assert_identical(result[budget], result["expected"])


def test_one_collective_per_bucket_not_per_parameter(gathered: list[dict[str, Any]]) -> None:
    for result in gathered:
        # DTensor's own gather is left to what the buckets cannot take (here: nothing; `plain` needs no gather)
        assert result["default"]["calls"] == {"all_gather_single": DEFAULT_BUCKETS, "full_tensor": 0}
        assert result["tiny"]["calls"] == {"all_gather_single": SHARDED, "full_tensor": 0}
        assert DEFAULT_BUCKETS < result["small"]["calls"]["all_gather_single"] < SHARDED
