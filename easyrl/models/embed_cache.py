"""The on-disk cache of vision-tower outputs (`data.cache_dir`, `data.cache_max_gb`): one safetensors file per video.

A key is the hex digest of three things, any change in which makes a new key (a miss, never a wrong hit):

* the media item's content: its processed patches and grid (``pixel_values_videos`` rows and ``(t, h, w)``), which
  already reflect every processor setting applied to the file;
* the processor's settings (``video_fps``, ``max_frames``, ``min/max_pixels``, patch, temporal patch and merge
  sizes), named in the entry's metadata so an entry can be read back and checked;
* the vision tower's weights version: a digest of its state (`tower_version`). Only a frozen tower has one; a tower
  being trained changes every step, so `easyrl.models.vl_embeds` bypasses this cache for it.

An entry holds the tower's outputs for the item (``pooler``: (tokens, H), Qwen3-VL's ``deepstack.{i}``: (tokens, H)
each) and metadata: the key, the settings and a checksum of the tensors' bytes. `get` reads an entry back only when
the file opens, its key matches, its format is this one and its checksum matches; anything else (a truncated write
from a killed process, a flipped byte, a file copied under another key) is logged in one line, deleted and reported
as a miss, so the caller recomputes and `put`s it afresh: never used.

Writes are atomic: a temporary file in the entry's folder, renamed over the entry (``os.replace``), so two ranks
writing the same key leave one complete entry and a reader never sees half a file. The size limit evicts the least
recently used entries (a hit touches the file's mtime) after each write until the total is under ``max_gb``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn


__all__ = ["FORMAT", "EmbedCache", "content_digest", "entry_key", "tower_version"]

logger = logging.getLogger(__name__)

FORMAT = "easyrl-embeds-1"
"""Written into every entry; an entry of another format is stale (rebuilt)."""
_SUFFIX = ".safetensors"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of `t` (CPU, contiguous); bf16 has no numpy dtype, so it is viewed as int16 first."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def content_digest(pixels: torch.Tensor, grid: torch.Tensor) -> str:
    """Digest of one media item: its processed patches (rows, D) and its grid (3,); dtype and shape included."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{pixels.dtype}{tuple(pixels.shape)}{[int(x) for x in grid.tolist()]}".encode())
    h.update(_tensor_bytes(pixels))
    return h.hexdigest()


def tower_version(tower: nn.Module) -> str:
    """Digest of a vision tower's state (names, dtypes, shapes and values of every parameter and buffer): the
    weights version of its cached outputs. Call it on unsharded tensors (before FSDP sharding)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(tower.state_dict().items()):
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def entry_key(content: str, settings: Mapping[str, Any], version: str) -> str:
    """The cache key of a media item's `content` digest under the processor `settings` and tower `version`."""
    blob = json.dumps({"content": content, "settings": dict(settings), "version": version}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=20).hexdigest()


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(_tensor_bytes(tensors[name]))
    return h.hexdigest()


class EmbedCache:
    """Vision-tower outputs on disk under `root`, at most `max_gb` in all (module doc)."""

    def __init__(self, root: str | os.PathLike[str], max_gb: float) -> None:
        if max_gb <= 0:
            raise ValueError(
                f"data.cache_max_gb must be > 0, got {max_gb}: set it to the disk space to give the cache"
            )
        self.root = Path(root)
        self.max_bytes = int(max_gb * 2**30)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0
        self.rebuilt = 0
        """Entries found corrupt, truncated or stale (deleted, recomputed by the caller)."""

    def path(self, key: str) -> Path:
        """Where the entry of `key` lives (two-character fan-out folders keep directories small)."""
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def get(self, key: str) -> list[torch.Tensor] | None:
        """The cached outputs of `key` (``pooler`` first, then the deepstack outputs), or None: a miss, or an entry
        that failed a check (logged, deleted)."""
        path = self.path(key)
        if not path.exists():
            self.misses += 1
            return None
        problem, tensors = self._read(path, key)
        if problem is not None:
            logger.warning("embedding cache: %s entry %s (%s): deleted, recomputing it", problem[0], path, problem[1])
            path.unlink(missing_ok=True)
            self.rebuilt += 1
            self.misses += 1
            return None
        os.utime(path)  # the LRU clock: a hit makes the entry the most recently used
        self.hits += 1
        return tensors

    def _read(self, path: Path, key: str) -> tuple[tuple[str, str] | None, list[torch.Tensor]]:
        """(None, tensors) for a sound entry, else ((kind, why), [])."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        except Exception as exc:  # safetensors raises its own error types for truncated or garbled headers
            return ("corrupt", f"{type(exc).__name__}: {exc}"), []
        if meta.get("format") != FORMAT or meta.get("key") != key:
            return ("stale", f"format {meta.get('format')!r}, key {meta.get('key')!r}"), []
        if _checksum(tensors) != meta.get("checksum"):
            return ("corrupt", "checksum mismatch"), []
        count = int(meta.get("deepstack", "0"))
        names = ["pooler", *(f"deepstack.{i}" for i in range(count))]
        if set(names) != set(tensors):
            return ("corrupt", f"tensors {sorted(tensors)}, expected {names}"), []
        return None, [tensors[n] for n in names]

    def put(self, key: str, outputs: Sequence[torch.Tensor], settings: Mapping[str, Any]) -> None:
        """Store `outputs` (``pooler``, then deepstack outputs) under `key`, atomically; then evict to the limit."""
        from safetensors.torch import save_file

        tensors = {"pooler": outputs[0].detach().to("cpu").contiguous()}
        for i, t in enumerate(outputs[1:]):
            tensors[f"deepstack.{i}"] = t.detach().to("cpu").contiguous()
        meta = {
            "format": FORMAT,
            "key": key,
            "checksum": _checksum(tensors),
            "deepstack": str(len(outputs) - 1),
            "settings": json.dumps(dict(settings), sort_keys=True),
        }
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name no other writer uses; the rename is atomic on one file system, and the last writer of a key wins
        # with an entry as complete as the first's (the same key holds the same values).
        tmp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.evict()

    def entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of every entry, oldest first."""
        found = []
        for path in self.root.glob(f"*/*{_SUFFIX}"):
            try:
                st = path.stat()
            except FileNotFoundError:  # evicted or replaced by another rank meanwhile
                continue
            found.append((st.st_mtime, st.st_size, path))
        return sorted(found)

    def evict(self) -> int:
        """Delete least recently used entries until the total is at most the limit; returns how many went."""
        found = self.entries()
        total = sum(size for _, size, _ in found)
        gone = 0
        for _, size, path in found:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            gone += 1
        return gone
