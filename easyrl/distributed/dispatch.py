"""Declaring how a worker method is called through a :class:`~easyrl.distributed.WorkerGroup`.

A worker method becomes callable from the driver once it is decorated with :func:`register`::

    class Worker:
        @register(dispatch=Dispatch.DP_SPLIT)
        def compute_log_probs(self, batch: Batch) -> Batch: ...

The modes (every mode calls *every* rank, because collectives need all ranks):

* ``ALL``: the same arguments to every rank; the result is the list of the ranks' results, in rank order.
* ``RANK0``: the same arguments to every rank; the result is rank 0's result.
* ``ALL_MERGED``: the same arguments to every rank; the ranks' dicts of metrics merged into one (see
  :func:`merge_metrics`): a lifecycle call whose timings the driver logs once (an engine session's open and close).
* ``DP_SPLIT``: the first positional argument is a batch object, split with ``batch.chunk(world_size)``; rank
  ``i`` gets chunk ``i`` (the other arguments go unchanged to every rank). The ranks' results are collected with
  :func:`collect_dp_results`: batch objects are concatenated back in rank order with ``type(result).concat``,
  dicts of metrics are merged (see :func:`merge_metrics`). With sequence parallelism (the group's
  ``ranks_per_dp`` > 1) the batch is split over the ``world_size // ranks_per_dp`` data-parallel groups of
  consecutive ranks, every rank of a group gets the group's chunk, and only each group's first result is collected.
* ``ENGINE_SPLIT``: like ``DP_SPLIT``, but over the group's rollout engines: when one tensor-parallel engine spans
  ``ranks_per_engine`` consecutive ranks (SPMD, every rank of an engine must be given the same requests), the batch
  is split into ``world_size // ranks_per_engine`` chunks, every rank of engine ``e`` gets chunk ``e``, and only
  the first rank of each engine's result is collected. With one rank per engine it is ``DP_SPLIT``.

A batch object is duck-typed: anything with a ``chunk(n) -> list`` method and a ``concat(list)``
classmethod or staticmethod.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar


__all__ = [
    "DISPATCH_ATTR",
    "Dispatch",
    "DispatchSpec",
    "Total",
    "collect_dp_results",
    "get_dispatch",
    "is_batch",
    "merge_metrics",
    "register",
    "registered_methods",
    "split_dp_args",
    "split_grouped_args",
]

DISPATCH_ATTR = "_easyrl_dispatch"

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(str, enum.Enum):
    """How a worker-group call spreads its arguments over the ranks and gathers the results."""

    ALL = "all"
    ALL_MERGED = "all_merged"
    RANK0 = "rank0"
    DP_SPLIT = "dp_split"
    ENGINE_SPLIT = "engine_split"


@dataclass(frozen=True)
class DispatchSpec:
    """The dispatch declared on a method by :func:`register`."""

    dispatch: Dispatch


def register(dispatch: Dispatch | str = Dispatch.ALL) -> Callable[[F], F]:
    """Declare ``dispatch`` on a worker method, making it callable through a worker group.

    The function itself is unchanged; the declaration is stored as a method attribute.
    """
    mode = Dispatch(dispatch)

    def decorate(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, DispatchSpec(mode))
        return fn

    return decorate


def get_dispatch(fn: Any) -> DispatchSpec | None:
    """The dispatch declared on ``fn``, or ``None`` if it is not declared."""
    spec = getattr(fn, DISPATCH_ATTR, None)
    return spec if isinstance(spec, DispatchSpec) else None


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """The methods of ``cls`` (and its bases) declared with :func:`register`, by name."""
    found: dict[str, DispatchSpec] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        spec = get_dispatch(getattr(cls, name, None))
        if spec is not None:
            found[name] = spec
    return found


def is_batch(obj: Any) -> bool:
    """Whether ``obj`` is a batch object (has ``chunk`` and a class-level ``concat``)."""
    return callable(getattr(obj, "chunk", None)) and callable(getattr(type(obj), "concat", None))


def split_dp_args(
    world_size: int, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Per-rank ``(args, kwargs)`` for a ``DP_SPLIT`` call: the first positional argument is chunked.

    Raises:
        TypeError: no positional argument, or it is not a batch object.
        ValueError: the batch size is not divisible by ``world_size``, or ``chunk`` gave the wrong count.
    """
    if not args:
        raise TypeError("a DP_SPLIT method takes the batch as its first positional argument")
    batch, rest = args[0], tuple(args[1:])
    if not is_batch(batch):
        raise TypeError(
            f"a DP_SPLIT method needs a batch object with chunk(n) and a concat classmethod, got {type(batch).__name__}"
        )
    try:
        size = len(batch)
    except TypeError:
        size = None
    if size is not None and size % world_size != 0:
        raise ValueError(
            f"a batch of {size} cannot be split evenly over {world_size} workers: make the batch size a multiple "
            f"of the world size"
        )
    chunks = list(batch.chunk(world_size))
    if len(chunks) != world_size:
        raise ValueError(f"{type(batch).__name__}.chunk({world_size}) returned {len(chunks)} chunks")
    return [((chunk, *rest), dict(kwargs)) for chunk in chunks]


def split_grouped_args(
    world_size: int, ranks_per_group: int, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Per-rank ``(args, kwargs)`` with one chunk per group of ``ranks_per_group`` consecutive ranks, repeated for
    its ranks: the rollout engines of an ``ENGINE_SPLIT`` call, the data-parallel groups of a ``DP_SPLIT`` call
    under sequence parallelism (1: rank ``i`` gets chunk ``i``)."""
    if ranks_per_group < 1 or world_size % ranks_per_group:
        raise ValueError(f"ranks_per_group={ranks_per_group} must divide the world size {world_size}")
    per_group = split_dp_args(world_size // ranks_per_group, args, kwargs)
    return [per_group[rank // ranks_per_group] for rank in range(world_size)]


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a scalar number (Python, numpy or a one-element tensor), else ``None``."""
    if isinstance(value, numbers.Number):
        return float(value)  # type: ignore[arg-type]
    item = getattr(value, "item", None)
    if callable(item):
        numel = getattr(value, "numel", None)
        count = numel() if callable(numel) else getattr(value, "size", None)
        if count == 1:
            scalar = item()
            if isinstance(scalar, numbers.Number):
                return float(scalar)  # type: ignore[arg-type]
    return None


def _mean_value(values: list[Any]) -> Any:
    """The mean of numeric ``values``; ``values[0]`` when any of them is not numeric."""
    floats = [_as_float(v) for v in values]
    if any(f is None for f in floats):
        return values[0]
    return sum(f for f in floats if f is not None) / len(floats)


class Total(float):
    """A per-rank count whose group value is the sum over the ranks (`merge_metrics`), not the mean.

    Most metrics are per-rank estimates of one quantity (a loss, a time), so the group's value is their mean; a
    count of events (engine restarts) is each rank's share of a total. The rank marks the value itself rather than
    the merge keeping a list of names, so the lower floor knows nothing of which metrics exist.
    """

    __slots__ = ()


def merge_metrics(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge the ranks' metric dicts: for each key, the mean over the ranks that report it, or the sum when every
    rank marks its value a `Total`.

    Values may be Python numbers, numpy scalars or one-element tensors (the mean is a ``float``). Lists are
    concatenated in rank order (per-sample values). A key whose values are anything else keeps rank 0's value
    (the first rank that reports it). Keys keep the order of their first appearance.
    """
    keys: list[str] = []
    for metrics in per_rank:
        keys.extend(k for k in metrics if k not in keys)
    merged: dict[str, Any] = {}
    for key in keys:
        values = [m[key] for m in per_rank if key in m]
        if all(isinstance(v, list) for v in values):
            merged[key] = [x for v in values for x in v]
        elif all(isinstance(v, Total) for v in values):
            merged[key] = Total(sum(values))
        else:
            merged[key] = _mean_value(values)
    return merged


def collect_dp_results(results: list[Any]) -> Any:
    """Gather the ranks' results of a ``DP_SPLIT`` call (in rank order).

    * batch objects: ``type(results[0]).concat(results)``;
    * dicts: :func:`merge_metrics`;
    * a tuple (e.g. ``(batch, metrics)``): each position collected on its own;
    * all ``None``: ``None``;
    * anything else: the list of results unchanged.
    """
    if not results:
        return results
    first = results[0]
    if all(r is None for r in results):
        return None
    if all(is_batch(r) for r in results):
        return type(first).concat(list(results))
    if all(isinstance(r, dict) for r in results):
        return merge_metrics(results)
    if all(isinstance(r, tuple) and len(r) == len(first) for r in results):
        return tuple(collect_dp_results([r[i] for r in results]) for i in range(len(first)))
    return list(results)
