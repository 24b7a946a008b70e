"""The SFT driver's step arithmetic (`easyrl.trainer.sft_math`) on hand-made batches."""

from __future__ import annotations

import pytest
import torch

from easyrl.batch import Batch
from easyrl.data.sft import collate_sft
from easyrl.trainer.sft_math import count_sft_steps, fill_for_workers, step_metrics


def _batch() -> Batch:
    items = [
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "loss_mask": [1, 0]},
        {"prompt_ids": [6], "response_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
        {"prompt_ids": [6, 6], "response_ids": [7], "loss_mask": [1]},
    ]
    return Batch(collate_sft(items, pad_token_id=0))


def test_steps_are_full_batches_times_epochs_capped_by_max_steps() -> None:
    assert count_sft_steps(rows=100, batch_size=32, epochs=2, max_steps=None) == 6  # 3 full batches an epoch
    assert count_sft_steps(rows=100, batch_size=32, epochs=2, max_steps=4) == 4
    assert count_sft_steps(rows=100, batch_size=32, epochs=1, max_steps=50) == 3
    with pytest.raises(ValueError, match="cannot fill one batch"):
        count_sft_steps(rows=10, batch_size=32, epochs=1, max_steps=None)


def test_fill_for_workers_adds_rows_that_train_nothing() -> None:
    batch = _batch()
    filled = fill_for_workers(batch, 2)
    assert len(filled) == 4
    assert torch.equal(filled["input_ids"][3], batch["input_ids"][2])  # a copy of the last row: a valid forward
    assert filled["loss_mask"][3].sum() == 0 and torch.equal(filled["loss_mask"][:3], batch["loss_mask"])
    assert batch["loss_mask"][2].sum() == 1  # the caller's batch is left as it was
    assert fill_for_workers(batch, 3) is batch


def test_step_metrics_count_tokens_and_throughput() -> None:
    got = step_metrics(_batch(), {"step": 2.0, "update": 1.0}, n_workers=2)
    # 5 + 4 + 3 attended tokens; 1 + 2 + 1 trained
    assert got["train/tokens"] == 12.0 and got["train/trained_tokens"] == 4.0
    assert got["train/seq_length/mean"] == 4.0 and got["train/seq_length/max"] == 5.0
    assert got["perf/throughput"] == pytest.approx(12 / 2.0 / 2)
    assert got["timing_per_token_ms/update"] == pytest.approx(1000 / 12)
