"""`easyrl.distributed.weight_bus`: a standalone broadcast group (gloo here) carries every tensor of a manifest
bit for bit, whatever its dtype, from the sender to each receiver, beside a default process group of its own."""

from __future__ import annotations

import io
import multiprocessing as mp
from typing import Any

import torch

from easyrl.distributed.weight_bus import BusAddress, WeightBus, manifest_bytes, manifest_of, sender_address


def _weights() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        ("embed.weight", torch.randn(50, 16, generator=gen)),
        ("layer.bf16", torch.randn(16, 16, generator=gen).to(torch.bfloat16)),
        ("layer.half", torch.randn(3, 5, generator=gen).to(torch.float16)),
        ("buffer.ids", torch.randint(0, 1000, (7,), generator=gen)),
        ("scalar", torch.tensor(3.5)),
    ]


def _receiver(address: BusAddress, rank: int, queue: Any) -> None:
    manifest = manifest_of(_weights())
    bus = WeightBus(address, rank, torch.device("cpu"), timeout_s=60)
    received = {entry.name: bus.receive(entry) for entry in manifest}
    bus.close()
    # Bytes, not tensors: torch's queue would pass a tensor as a file descriptor served by this process, which may
    # have exited by the time the test reads it (CI saw FileNotFoundError from the resource sharer).
    buffer = io.BytesIO()
    torch.save(received, buffer)
    queue.put((rank, buffer.getvalue()))


def test_every_receiver_gets_every_tensor_bit_for_bit() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address = sender_address(world_size=3)
    receivers = [ctx.Process(target=_receiver, args=(address, rank, queue)) for rank in (1, 2)]
    for proc in receivers:
        proc.start()
    try:
        bus = WeightBus(address, 0, torch.device("cpu"), timeout_s=60)  # returns once both receivers joined
        for _, tensor in _weights():
            bus.send(tensor)
        got = {
            rank: torch.load(io.BytesIO(raw), weights_only=True)
            for rank, raw in (queue.get(timeout=60) for _ in receivers)
        }
    finally:
        for proc in receivers:
            proc.join(timeout=60)
    assert sorted(got) == [1, 2]
    for rank, weights in got.items():
        assert list(weights) == [name for name, _ in _weights()], rank  # the manifest's order
        for name, sent in _weights():
            received = weights[name]
            assert received.dtype == sent.dtype and received.shape == sent.shape, (rank, name)
            assert torch.equal(received, sent), (rank, name)
    assert all(proc.exitcode == 0 for proc in receivers)
    assert manifest_bytes(manifest_of(_weights())) == sum(t.numel() * t.element_size() for _, t in _weights())
