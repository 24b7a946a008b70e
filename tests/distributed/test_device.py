"""`choose_device` over what a process sees: the launcher, its visible GPUs, its local rank."""

from __future__ import annotations

import pytest
import torch

from easyrl.distributed.device import choose_device, detect_launcher


@pytest.mark.parametrize(
    ("visible", "local_rank", "count", "launcher", "ray_ids", "expected"),
    [
        # Ray gives each worker (num_gpus=1) its own GPU as CUDA_VISIBLE_DEVICES: index 0 at every local rank.
        (["5"], 5, 1, "ray", ["5"], "cuda:0"),
        (["3"], 3, 1, "ray", [], "cuda:0"),
        # Ray told not to narrow the visible devices: the worker's own is where its assigned id sits among them.
        (["0", "1", "2", "3"], 1, 4, "ray", ["2"], "cuda:2"),
        (["4", "6"], 0, 2, "ray", ["6"], "cuda:1"),
        # torchrun shows every GPU of the node: cuda:LOCAL_RANK.
        (None, 3, 8, "torchrun", [], "cuda:3"),
        (["0", "1"], 1, 2, "single", [], "cuda:1"),
        (None, 0, 1, "torchrun", [], "cuda:0"),
        # no GPU visible: the CPU, whatever the rank
        ([], 2, 0, "ray", [], "cpu"),
        (None, 0, 0, "single", [], "cpu"),
    ],
)
def test_choose_device(visible, local_rank, count, launcher, ray_ids, expected) -> None:
    assert choose_device(visible, local_rank, count, launcher, ray_ids) == torch.device(expected)


def test_choose_device_refuses_what_it_cannot_tell() -> None:
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but this process sees 2 GPUs"):
        choose_device(None, 4, 2, "torchrun")
    with pytest.raises(ValueError, match="RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        choose_device(["0", "1"], 1, 2, "ray", [])


def test_detect_launcher() -> None:
    assert detect_launcher({"EASYRL_ROLE": "actor", "LOCAL_RANK": "1"}) == "ray"
    assert detect_launcher({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1"}) == "torchrun"
    assert detect_launcher({"LOCAL_RANK": "1"}) == "single"
