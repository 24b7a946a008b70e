"""The SFT driver's per-step arithmetic on a `Batch` (`easyrl.data.sft.collate_sft`'s layout), free of workers and I/O
so it reads and tests alone; the loss itself is `easyrl.algorithms.sft`."""

from __future__ import annotations

from easyrl.batch import Batch


def count_sft_steps(rows: int, batch_size: int, epochs: int, max_steps: int | None) -> int:
    """Optimizer steps of the run: full batches of `batch_size` rows per epoch (the tail that cannot fill one is
    left for the next epoch's order), times `epochs`, capped by `max_steps`."""
    if rows < batch_size:
        raise ValueError(f"{rows} rows cannot fill one batch of {batch_size}")
    total = rows // batch_size * epochs
    return total if max_steps is None else min(total, max_steps)


def fill_for_workers(batch: Batch, parts: int) -> Batch:
    """`batch` with copies of its last row appended until it splits into `parts` equal shares; the copies' `loss_mask`
    (B, R) is all zero, so they join every forward (each rank must run the same collectives) and count for nothing."""
    real = len(batch)
    extra = (-real) % parts
    if not extra:
        return batch
    filled = batch.index(list(range(real)) + [real - 1] * extra)
    mask = filled["loss_mask"].clone()
    mask[real:] = 0
    return filled.set(loss_mask=mask)


def step_metrics(batch: Batch, timings: dict[str, float], n_workers: int) -> dict[str, float]:
    """Tokens of the step (every attended one, and the trained ones), sequence lengths, and throughput: tokens per
    second per worker over the whole step (verl's `perf/throughput`), milliseconds per token of each stage."""
    lengths = batch["attention_mask"].sum(dim=1).float()
    total = float(lengths.sum())
    step = timings.get("step", 0.0)
    out = {
        "train/tokens": total,
        "train/trained_tokens": float(batch["loss_mask"].sum()),
        "train/seq_length/mean": float(lengths.mean()),
        "train/seq_length/max": float(lengths.max()),
        "perf/total_num_tokens": total,
        "perf/time_per_step": step,
        "perf/throughput": total / max(step, 1e-9) / n_workers,
    }
    out |= {f"timing_per_token_ms/{stage}": 1000.0 * seconds / max(total, 1.0) for stage, seconds in timings.items()}
    return out
