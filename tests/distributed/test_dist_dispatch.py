"""Dispatch declarations, batch splitting and result gathering (no Ray)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from easyrl.distributed import Dispatch, merge_metrics, register
from easyrl.distributed.dispatch import (
    Total,
    collect_dp_results,
    get_dispatch,
    registered_methods,
    split_dp_args,
    split_grouped_args,
)


@dataclass
class Batch:
    """The smallest batch object: a list of values."""

    values: list[int]

    def __len__(self) -> int:
        return len(self.values)

    def chunk(self, n: int) -> list[Batch]:
        size = len(self.values) // n
        return [Batch(self.values[i * size : (i + 1) * size]) for i in range(n)]

    @classmethod
    def concat(cls, parts: list[Batch]) -> Batch:
        return cls([v for part in parts for v in part.values])


class Worker:
    @register(dispatch=Dispatch.DP_SPLIT)
    def split(self, batch: Batch) -> Batch:
        return batch

    @register(Dispatch.RANK0)
    def first(self) -> int:
        return 0

    @register("all")
    def every(self) -> int:
        return 1

    def plain(self) -> None:
        pass


def test_register_keeps_function_and_records_mode() -> None:
    assert Worker().every() == 1
    assert get_dispatch(Worker.split).dispatch is Dispatch.DP_SPLIT  # type: ignore[union-attr]
    assert get_dispatch(Worker.plain) is None
    assert registered_methods(Worker) == {
        "every": get_dispatch(Worker.every),
        "first": get_dispatch(Worker.first),
        "split": get_dispatch(Worker.split),
    }


def test_split_dp_args_gives_rank_i_chunk_i() -> None:
    per_rank = split_dp_args(2, (Batch([1, 2, 3, 4]), "x"), {"k": 1})
    assert per_rank == [((Batch([1, 2]), "x"), {"k": 1}), ((Batch([3, 4]), "x"), {"k": 1})]


def test_split_dp_args_rejects_bad_batches() -> None:
    with pytest.raises(ValueError, match="cannot be split evenly over 2"):
        split_dp_args(2, (Batch([1, 2, 3]),), {})
    with pytest.raises(TypeError, match="batch object"):
        split_dp_args(2, ([1, 2],), {})
    with pytest.raises(TypeError, match="first positional"):
        split_dp_args(2, (), {})


def test_split_grouped_args_gives_every_rank_of_an_engine_its_chunk() -> None:
    per_rank = split_grouped_args(4, 2, (Batch([1, 2, 3, 4]),), {})
    assert [args[0].values for args, _ in per_rank] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert [args[0].values for args, _ in split_grouped_args(2, 1, (Batch([1, 2]),), {})] == [[1], [2]]
    assert [args[0].values for args, _ in split_grouped_args(2, 2, (Batch([1, 2, 3]),), {})] == [[1, 2, 3]] * 2
    with pytest.raises(ValueError, match="ranks_per_group=3 must divide the world size 4"):
        split_grouped_args(4, 3, (Batch([1, 2, 3, 4]),), {})


def test_collect_concatenates_batches_in_rank_order() -> None:
    assert collect_dp_results([Batch([1, 2]), Batch([3, 4])]) == Batch([1, 2, 3, 4])
    out = collect_dp_results([(Batch([1]), {"a": 1.0}), (Batch([2]), {"a": 3.0})])
    assert out == (Batch([1, 2]), {"a": 2.0})
    assert collect_dp_results([None, None]) is None
    assert collect_dp_results([1, 2]) == [1, 2]


def test_merge_metrics_means_over_ranks() -> None:
    merged = merge_metrics(
        [
            {"loss": 1.0, "acc": np.float32(0.5), "grad": torch.tensor(2.0), "lens": [1, 2], "name": "a"},
            {"loss": 3, "acc": np.float32(1.0), "grad": torch.tensor([4.0]), "lens": [3], "name": "b", "only": 7},
        ]
    )
    assert merged == {"loss": 2.0, "acc": 0.75, "grad": 3.0, "lens": [1, 2, 3], "name": "a", "only": 7.0}


def test_merge_metrics_sums_counts_every_rank_marks_total() -> None:
    """A count (engine restarts) is the group's total; a key not marked on every rank is still a mean."""
    merged = merge_metrics([{"restarts": Total(1), "mixed": Total(2)}, {"restarts": Total(2), "mixed": 4.0}, {}])
    assert merged == {"restarts": 3.0, "mixed": 3.0} and isinstance(merged["restarts"], Total)
    assert json.dumps(merged) == '{"restarts": 3.0, "mixed": 3.0}'  # logs as a plain number
