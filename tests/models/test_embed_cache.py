"""The on-disk cache of vision-tower outputs: round trip, keys, corrupt / truncated / stale entries rebuilt never used,
LRU eviction under the size limit, and concurrent writers of one key."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.models.embed_cache import EmbedCache, content_digest, entry_key, tower_version


SETTINGS = {"video_fps": 2.0, "max_frames": 64.0}


def _outputs(seed: int, tokens: int = 16, deep: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, 8, generator=g) for _ in range(1 + deep)]


def test_round_trip_and_counts(tmp_path: Path) -> None:
    cache = EmbedCache(tmp_path, max_gb=1.0)
    assert cache.get("ab" * 20) is None
    outs = _outputs(0)
    cache.put("ab" * 20, outs, SETTINGS)
    got = cache.get("ab" * 20)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, outs))
    assert (cache.hits, cache.misses, cache.rebuilt) == (1, 1, 0)
    bf16 = [t.bfloat16() for t in _outputs(1, deep=0)]
    cache.put("cd" * 20, bf16, SETTINGS)
    back = cache.get("cd" * 20)
    assert back is not None and len(back) == 1 and torch.equal(back[0], bf16[0])


def test_keys_follow_content_settings_and_version() -> None:
    pixels, grid = torch.randn(8, 12), torch.tensor([2, 2, 2])
    base = entry_key(content_digest(pixels, grid), SETTINGS, "v1")
    changed = pixels.clone()
    changed[3, 4] += 1e-3
    assert entry_key(content_digest(changed, grid), SETTINGS, "v1") != base
    assert entry_key(content_digest(pixels, torch.tensor([1, 4, 2])), SETTINGS, "v1") != base
    assert entry_key(content_digest(pixels, grid), {**SETTINGS, "video_fps": 1.0}, "v1") != base
    assert entry_key(content_digest(pixels, grid), SETTINGS, "v2") != base
    assert entry_key(content_digest(pixels.clone(), grid.clone()), dict(SETTINGS), "v1") == base


def test_tower_version_changes_with_any_weight() -> None:
    tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    v0 = tower_version(tower)
    assert tower_version(tower) == v0
    with torch.no_grad():
        tower[1].bias[2] += 1e-6
    assert tower_version(tower) != v0


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data: the file still opens, the checksum catches it
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a killed writer's half file


@pytest.mark.parametrize("damage", ["flip", "truncate", "stale", "garbage"])
def test_damaged_entry_is_rebuilt_not_used(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    cache = EmbedCache(tmp_path, max_gb=1.0)
    key = "ab" * 20
    outs = _outputs(0)
    if damage == "stale":  # a sound entry written for another key, found under this one
        cache.put("cd" * 20, _outputs(1), SETTINGS)
        cache.path(key).parent.mkdir(parents=True, exist_ok=True)
        os.replace(cache.path("cd" * 20), cache.path(key))
    else:
        cache.put(key, outs, SETTINGS)
        path = cache.path(key)
        if damage == "flip":
            _corrupt_flip(path)
        elif damage == "truncate":
            _corrupt_truncate(path)
        else:
            path.write_bytes(b"not a safetensors file at all")
    with caplog.at_level(logging.WARNING, logger="easyrl.models.embed_cache"):
        assert cache.get(key) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and ("stale" if damage == "stale" else "corrupt") in lines[0] and key in lines[0]
    assert not cache.path(key).exists() and cache.rebuilt == 1
    cache.put(key, outs, SETTINGS)  # the caller recomputes and stores it afresh
    got = cache.get(key)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, outs))


def test_lru_eviction_under_the_limit(tmp_path: Path) -> None:
    one = EmbedCache(tmp_path / "probe", max_gb=1.0)
    one.put("00" * 20, _outputs(0), SETTINGS)
    size = one.path("00" * 20).stat().st_size
    cache = EmbedCache(tmp_path / "c", max_gb=3.5 * size / 2**30)  # room for three entries
    keys = [f"{i:02d}" * 20 for i in range(1, 5)]
    for i, key in enumerate(keys[:3]):
        cache.put(key, _outputs(i), SETTINGS)
        os.utime(cache.path(key), (time.time() - 100 + i, time.time() - 100 + i))  # distinct, ordered mtimes
    assert cache.get(keys[0]) is not None  # used: now the most recent
    cache.put(keys[3], _outputs(3), SETTINGS)  # over the limit: the least recently used (keys[1]) goes
    assert [cache.path(k).exists() for k in keys] == [True, False, True, True]
    assert sum(size for _, size, _ in cache.entries()) <= cache.max_bytes


def test_bad_limit_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.cache_max_gb"):
        EmbedCache(tmp_path, max_gb=0)


def _writer(root: str, key: str, rounds: int, start: Any) -> None:
    cache = EmbedCache(root, max_gb=1.0)
    start.wait(timeout=120)  # imports done: write at once, together with the other writer and under the reads
    for _ in range(rounds):
        cache.put(key, _outputs(7, tokens=512), SETTINGS)


def test_concurrent_writers_of_one_key(tmp_path: Path) -> None:
    """Two processes (two ranks) writing the same key over and over while this one reads: every read is a sound
    entry or a miss, never a half file; one complete entry is left and no temporary file."""
    key = "ab" * 20
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, 30, start)) for _ in range(2)]
    for p in procs:
        p.start()
    reader = EmbedCache(tmp_path, max_gb=1.0)
    want = _outputs(7, tokens=512)
    # The reads spin only once both writers are up: spinning through their Python start and torch import took a
    # core from them on 2 cores (6 CPU-s of the test's 9) and read nothing but misses.
    start.wait(timeout=120)
    while any(p.is_alive() for p in procs):
        got = reader.get(key)
        assert got is None or all(torch.equal(a, b) for a, b in zip(got, want))
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reader.rebuilt == 0
    got = reader.get(key)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{key}.safetensors"]
