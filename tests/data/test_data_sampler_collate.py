"""PromptSampler (deterministic, exactly resumable) and collate_prompts (left padding)."""

from __future__ import annotations

import json

import pytest
import torch

from easyrl.data import PromptSampler, collate_prompts


def _take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(steps)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_epochs_are_permutations_and_deterministic() -> None:
    sampler = PromptSampler(dataset_len=12, batch_size=4, shuffle=True, seed=7)
    assert sampler.steps_per_epoch == 3
    epoch0 = _flat(_take(sampler, 3))
    assert sorted(epoch0) == list(range(12))
    assert sampler.epoch == 1
    epoch1 = _flat(_take(sampler, 3))
    assert sorted(epoch1) == list(range(12)) and epoch1 != epoch0
    again = PromptSampler(dataset_len=12, batch_size=4, shuffle=True, seed=7)
    assert _flat(_take(again, 6)) == epoch0 + epoch1
    other_seed = PromptSampler(dataset_len=12, batch_size=4, shuffle=True, seed=8)
    assert _flat(_take(other_seed, 3)) != epoch0
    # The order of an epoch depends only on (seed, epoch).
    assert list(PromptSampler(12, 4, True, 7).order(1)) == epoch1


def test_no_shuffle_and_drop_last() -> None:
    sampler = PromptSampler(dataset_len=10, batch_size=3, shuffle=False, seed=0)
    assert sampler.steps_per_epoch == 3
    assert _take(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]  # index 9 dropped in epoch 0
    assert sampler.epoch == 1


def test_keep_last_fills_from_next_epoch() -> None:
    sampler = PromptSampler(dataset_len=10, batch_size=3, shuffle=False, seed=0, drop_last=False)
    assert sampler.steps_per_epoch == 4
    assert _take(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert sampler.epoch == 1
    tiny = PromptSampler(dataset_len=2, batch_size=5, shuffle=False, seed=0, drop_last=False)
    assert tiny.next_indices() == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 7])  # mid-epoch, at and across epoch boundaries
def test_resume_continues_identically(drop_last: bool, stop_after: int) -> None:
    reference = PromptSampler(dataset_len=11, batch_size=4, shuffle=True, seed=3, drop_last=drop_last)
    expected = _take(reference, 12)
    first = PromptSampler(dataset_len=11, batch_size=4, shuffle=True, seed=3, drop_last=drop_last)
    got = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = PromptSampler(dataset_len=11, batch_size=4, shuffle=True, seed=3, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch and resumed.steps == stop_after
    got += _take(resumed, 12 - stop_after)
    assert got == expected


def test_state_is_plain_ints() -> None:
    sampler = PromptSampler(dataset_len=5, batch_size=2, shuffle=True, seed=1)
    sampler.next_indices()
    state = sampler.state_dict()
    assert all(isinstance(value, int) for value in state.values())
    assert state["epoch"] == 0 and state["position"] == 2


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptSampler(dataset_len=3, batch_size=4, shuffle=False, seed=0)
    with pytest.raises(ValueError):
        PromptSampler(dataset_len=0, batch_size=1, shuffle=False, seed=0)


def test_collate_left_pads_to_longest_prompt() -> None:
    items = [
        {"prompt_ids": [5, 6, 7], "raw_prompt": "a", "ground_truth": "1", "row": {"k": 1}, "index": 4},
        {"prompt_ids": [8], "raw_prompt": "b", "ground_truth": 2, "row": {"k": 2}, "index": 9},
    ]
    batch = collate_prompts(items, pad_token_id=0, max_prompt_length=16)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]  # width 3, not max_prompt_length
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch["raw_prompt"] == ["a", "b"]
    assert batch["ground_truth"] == ["1", 2]
    assert batch["row"] == [{"k": 1}, {"k": 2}]
    assert batch["index"] == [4, 9]
    with pytest.raises(ValueError, match="max_prompt_length"):
        collate_prompts(items, pad_token_id=0, max_prompt_length=2)
