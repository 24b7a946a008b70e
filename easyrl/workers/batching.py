"""Dynamic batching: micro-batches formed by a token budget instead of a fixed sample count.

Samples are assigned to micro-batches by a balanced greedy bin packing (longest first, each to the least loaded
bin), so micro-batches carry similar numbers of valid tokens and none exceeds the budget unless one sample alone
does. The partition permutes the samples: forward passes return it so the caller restores the original order.

FSDP2 all-gathers every unit's parameters in each forward (and reduce-scatters in each backward), so all ranks
must run the same number of micro-batches. The count is all-reduced (MAX) over ranks and every rank partitions its
samples into that many bins (splitting further keeps the bins balanced). A rank with fewer samples than the count
(impossible when ranks hold equal sample counts, as DP_SPLIT guarantees, but handled) runs dummy micro-batches:
a copy of one sample whose outputs are dropped and whose loss gets weight 0.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from easyrl.batch import Batch


def valid_token_counts(batch: Batch) -> list[int]:
    """Valid (non-pad) tokens of each sample: the attention mask's row sums."""
    return [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]


def _lpt(lengths: list[int], num_bins: int) -> list[list[int]]:
    """Longest-first greedy: each sample (longest first) goes to the currently least loaded bin."""
    heap = [(0, b) for b in range(num_bins)]  # (load, bin): a tie goes to the lowest bin
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    # Longest first; equal lengths by index, so the result is deterministic.
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def balanced_partition(lengths: list[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """Partition sample indices into the fewest (at least `min_bins`) balanced bins of at most `max_tokens` tokens.

    A sample longer than `max_tokens` gets a bin of its own. Bins hold ascending indices and are ordered by their
    first index, so the result is deterministic. When `min_bins` exceeds the number of samples the extra bins are
    empty (the caller runs dummies for them).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    n = len(lengths)
    # A sample over the budget fills a bin alone: count it as `max_tokens` for the lower bound.
    needed = math.ceil(sum(min(x, max_tokens) for x in lengths) / max_tokens)
    # At most one bin per sample; `min_bins` beyond that become empty bins at the end.
    num_bins = min(max(min_bins, needed, 1), max(n, 1))
    while True:
        bins = _lpt(lengths, num_bins)
        # A bin over budget with a single sample cannot be split: only a shared one calls for another bin.
        over = any(len(b) > 1 and sum(lengths[i] for i in b) > max_tokens for b in bins)
        if not over or num_bins >= n:
            break
        num_bins += 1
    bins = sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
    return bins + [[] for _ in range(max(0, min_bins - len(bins)))]


def sync_max(value: int) -> int:
    """The maximum of `value` over all ranks (a collective when distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@dataclass
class MicroBatches:
    """Micro-batches of one batch, in the order to run them."""

    parts: list[Batch]
    """The micro-batches; dummies (see `dummy`) come last."""
    dummy: list[bool]
    """Whether each part is a dummy run only to keep ranks in step (outputs dropped, loss weight 0)."""
    order: list[int] | None
    """Original index of each real sample, in the concatenated order of the real parts; None: unchanged."""

    def restore(self, stacked: torch.Tensor) -> torch.Tensor:
        """Put rows computed in the micro-batches' order back into the batch's original order."""
        if self.order is None:
            return stacked
        inverse = torch.empty(len(self.order), dtype=torch.long)
        # order[j] is the original index of computed row j; its inverse maps each original index to its row.
        inverse[torch.tensor(self.order, dtype=torch.long)] = torch.arange(len(self.order))
        return stacked[inverse]


def make_micro_batches(batch: Batch, micro_batch_size: int, max_token_len: int | None = None) -> MicroBatches:
    """Fixed-count micro-batches (`max_token_len` None), or token-budget ones with the same count on every rank."""
    if max_token_len is None:
        parts = batch.split(micro_batch_size)
        return MicroBatches(parts, [False] * len(parts), None)
    lengths = valid_token_counts(batch)
    # This rank's own bin count, then the most over all ranks: every rank partitions into that many bins.
    local = len(balanced_partition(lengths, max_token_len))
    bins = balanced_partition(lengths, max_token_len, min_bins=sync_max(local))
    real = [b for b in bins if b]
    parts = [batch.index(b) for b in real]
    n_dummy = len(bins) - len(real)
    parts += [batch.slice(0, 1)] * n_dummy  # a real row, so the forward is valid; outputs dropped
    return MicroBatches(parts, [False] * len(real) + [True] * n_dummy, [i for b in real for i in b])
