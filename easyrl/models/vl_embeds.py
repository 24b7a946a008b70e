"""One vision-tower encoding per media item, reused; under sequence parallelism, the frames split over the group.

`install_embed_reuse` replaces a Qwen-VL backbone's ``get_video_features`` and ``get_image_features`` (the two
methods its forward calls to run the tower) with `EmbedReuse.features`, which

* **deduplicates** within the call: the n samples of a prompt carry the same video; each distinct item (content
  digest of its patches and grid) is encoded once and its output indexed into every row that shows it. Gradients of
  the duplicates add up into the one encoding, as they would into n identical ones;
* **reuses across passes** when the tower is frozen (it then has a weights version, `embed_cache.tower_version`):
  an in-process memo (shared by every model of the process with the same version: the actor's old-log-prob pass,
  the reference, the update pass) and the on-disk `EmbedCache` serve items already encoded. A trained tower's outputs
  change every step: it bypasses both (said once in the log) and the update pass re-encodes, with gradients;
* **splits the frames over a sequence-parallel group** (the model carries the group, `easyrl.workers.ulysses`):
  Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers attend within one temporal patch group of a video (transformers' vision
  ``cu_seqlens`` repeat ``h * w`` per temporal step; window attention and the position embeddings depend on h, w
  only), so a video's ``t`` frames encode as ``t`` independent ``(1, h, w)`` items. Each rank of the group encodes a
  contiguous share of the frames to encode and one differentiable all-gather gives every rank the whole output; its
  backward sums each frame's gradient over the ranks (a reduce-scatter), so each rank's tower copy gets its share.

Exactly one tower call per method call keeps FSDP's collectives paired across ranks (`easyrl.models.vl_tower`): a
rank that finds everything cached makes none, and the vl_tower hook adds its dummy call as for a micro-batch without
media; a sequence-parallel rank with no frame of its own makes a dummy call in place, before the all-gather.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from easyrl.models.dtypes import DTYPES
from easyrl.models.embed_cache import EmbedCache, content_digest, entry_key


__all__ = ["MEMO_BYTES", "EmbedReuse", "TowerFeatures", "embed_reuse_of", "install_embed_reuse", "tower_settings"]

logger = logging.getLogger(__name__)

MEMO_BYTES = 2 * 2**30
"""Bound of the in-process memo of frozen-tower outputs (host memory; least recently used items go first)."""
_ATTRIBUTE = "easyrl_embed_reuse"
_SP_ATTRIBUTE = "easyrl_sequence_parallel"
"""Where `easyrl.workers.ulysses.SequenceParallel.attach` puts the model's group (read duck-typed: models/ does not
import workers/)."""


class _Memo:
    """Tower outputs by cache key, least recently used first out past `MEMO_BYTES`; kept on the host."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def get(self, key: str) -> list[torch.Tensor] | None:
        found = self.items.get(key)
        if found is not None:
            self.items.move_to_end(key)
        return found

    def put(self, key: str, outputs: list[torch.Tensor]) -> None:
        if key in self.items:
            return
        self.items[key] = [t.detach().to("cpu") for t in outputs]
        self.bytes += sum(t.numel() * t.element_size() for t in outputs)
        while self.bytes > MEMO_BYTES and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)


# Module-level on purpose: the actor and the reference are two model objects in one process; with the same frozen
# tower (same version in the key) the reference pass reads what the old-log-prob pass encoded.
_MEMO = _Memo()


@dataclass
class TowerFeatures:
    """What a Qwen-VL forward reads from ``get_*_features``: per item (tokens, H), and Qwen3-VL's deepstack outputs
    (per layer, per item)."""

    pooler_output: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]] | None = None


def _outputs(out: Any) -> list[torch.Tensor]:
    """A tower call's merged outputs: ``pooler`` (tokens, H), then Qwen3-VL's deepstack outputs."""
    deep = getattr(out, "deepstack_features", None)
    return [out.pooler_output, *(deep or [])]


class EmbedReuse:
    """The encoding of one backbone's media items (module doc); counters say what it did."""

    def __init__(
        self, backbone: nn.Module, version: str | None, cache: EmbedCache | None, settings: Mapping[str, Any]
    ) -> None:
        self.backbone = backbone
        self.visual: Any = backbone.visual
        self.version = version
        """The frozen tower's weights version; None: the tower is trained (no memo, no disk cache)."""
        self.cache = cache
        self.settings = dict(settings)
        self.encoded = 0
        """Media items (a split video counts once per rank holding frames of it) run through the tower."""
        self.reused = 0
        """Media items served without the tower (duplicates in a call, the memo, the disk cache)."""

    def _key(self, pixels: torch.Tensor, grid: torch.Tensor) -> str:
        return entry_key(content_digest(pixels, grid), self.settings, self.version or "trained")

    def lookup(self, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor] | None:
        """The held outputs (``pooler``, then deepstack outputs; on the host) of one item, `pixels` (rows, D) and
        `grid` (3,) as the data pipeline made them, without running the tower: from the memo, else the disk cache;
        None when not held, or when the tower is trained (its outputs of an earlier step are stale)."""
        if self.version is None:
            return None
        # The key digests the pixels in the dtype the tower's forward receives them: FSDP's mixed precision casts
        # a forward's float inputs to the parameter dtype (`compute_dtype`), so a bf16 run keys bf16 patches.
        dtype = DTYPES.get(str(self.settings.get("compute_dtype")), pixels.dtype)
        key = self._key(pixels.to(dtype), grid)
        hit = _MEMO.get(key)
        if hit is None and self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                _MEMO.put(key, hit)
        return hit

    def features(self, pixels: torch.Tensor, grid: torch.Tensor, *args: Any, **kwargs: Any) -> TowerFeatures:
        """Stand-in for ``get_video_features`` / ``get_image_features``: (rows, D) patches and (n, 3) grids ->
        per-item outputs (extra keyword arguments of the forward are not the tower's and are dropped)."""
        grid = grid.to(pixels.device)
        rows = grid.prod(-1).tolist()
        items = pixels.split(rows)
        keys = [self._key(p, g) for p, g in zip(items, grid)]
        order = list(OrderedDict.fromkeys(keys))  # distinct keys, first-seen order
        found: dict[str, list[torch.Tensor]] = {}
        reuse = self.version is not None
        if reuse:
            for key in order:
                hit = _MEMO.get(key)
                if hit is None and self.cache is not None:
                    hit = self.cache.get(key)
                    if hit is not None:
                        _MEMO.put(key, hit)
                if hit is not None:
                    found[key] = [t.to(pixels.device) for t in hit]
        sp = self._group()
        missing = [k for k in order if k not in found]
        if sp is not None:
            missing = self._agree(missing, order, sp, pixels.device)
            for key in missing:
                found.pop(key, None)
        first = {k: keys.index(k) for k in missing}
        if missing:
            todo = [(items[first[k]], grid[first[k]]) for k in missing]
            fresh = self._encode_split(todo, sp) if sp is not None else self._encode(todo)
            for key, outs in zip(missing, fresh):
                found[key] = outs
                if reuse:
                    _MEMO.put(key, outs)
                    if self.cache is not None:
                        self.cache.put(key, outs, self.settings)
        self.reused += len(keys) - len(missing)
        per_item = [found[k] for k in keys]
        deep = len(per_item[0]) - 1 if per_item else 0
        return TowerFeatures(
            tuple(o[0] for o in per_item),
            [tuple(o[1 + i] for o in per_item) for i in range(deep)] if deep else None,
        )

    def _group(self) -> Any:
        """The model's sequence-parallel group (an `SPGroup`) when it has more than one rank, else None."""
        sp = getattr(self.backbone, _SP_ATTRIBUTE, None)
        group = getattr(sp, "group", None)
        return group if group is not None and group.size > 1 else None

    def _agree(self, missing: list[str], order: list[str], sp: Any, device: torch.device) -> list[str]:
        """The keys some rank of the group misses (every rank encodes and gathers the same items: a disk entry
        written by one rank between two ranks' reads must not split the group)."""
        flags = torch.tensor([int(k in missing) for k in order], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=sp.group)
        return [k for k, f in zip(order, flags.tolist()) if f]

    def _call(self, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        out = self.visual(pixels.type(self.visual.dtype), grid_thw=grid)
        return _outputs(out)

    def _encode(self, todo: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        """One tower call on the distinct items `todo` ((rows, D), (3,)); their outputs, item by item."""
        merge = int(self.visual.spatial_merge_size) ** 2
        outs = self._call(torch.cat([p for p, _ in todo]), torch.stack([g for _, g in todo]))
        sizes = [int(g.prod()) // merge for _, g in todo]
        self.encoded += len(todo)
        split = [o.split(sizes) for o in outs]
        return [[s[i] for s in split] for i in range(len(todo))]

    def _encode_split(self, todo: Sequence[tuple[torch.Tensor, torch.Tensor]], sp: Any) -> list[list[torch.Tensor]]:
        """`_encode` with the frames of `todo` shared out over the group's ranks and all-gathered (module doc)."""
        from torch.distributed.nn.functional import all_gather

        merge = int(self.visual.spatial_merge_size) ** 2
        frames = [(i, f) for i, (_, g) in enumerate(todo) for f in range(int(g[0]))]
        tokens = [int(g[1] * g[2]) // merge for _, g in todo]  # merged tokens per frame of each item
        share = math.ceil(len(frames) / sp.size)
        chunks = [frames[r * share : (r + 1) * share] for r in range(sp.size)]
        mine = chunks[sp.rank]
        if mine:
            pix, grids = [], []
            for i, f in mine:  # consecutive frames of one item could share a grid row; one row per frame is simpler
                p, g = todo[i]
                per = int(g[1] * g[2])
                pix.append(p[f * per : (f + 1) * per])
                grids.append(torch.stack([torch.ones_like(g[0]), g[1], g[2]]))
            local = self._call(torch.cat(pix), torch.stack(grids))
            self.encoded += len({i for i, _ in mine})
        else:  # no frame here: a dummy call keeps this rank's FSDP collectives in step, before the all-gather
            like = todo[0][0]
            g = todo[0][1]
            per = int(g[1] * g[2])
            dummy = self._call(like[:per] * 0, torch.stack([torch.ones_like(g[0]), g[1], g[2]]))
            local = [d[:0] + 0.0 * d.sum() for d in dummy]
        width = max(sum(tokens[i] for i, _ in c) for c in chunks)
        gathered = []
        for t in local:
            padded = torch.cat([t, t.new_zeros(width - t.shape[0], *t.shape[1:])])
            parts = all_gather(padded, group=sp.group)
            lengths = [sum(tokens[i] for i, _ in c) for c in chunks]
            gathered.append(torch.cat([part[:n] for part, n in zip(parts, lengths)]))
        sizes = [tokens[i] * int(g[0]) for i, (_, g) in enumerate(todo)]
        split = [o.split(sizes) for o in gathered]
        return [[s[i] for s in split] for i in range(len(todo))]


def tower_settings(model: nn.Module) -> dict[str, int]:
    """The vision tower's patch geometry (patch, temporal patch and merge sizes): part of every cache key."""
    config = getattr(getattr(model, "config", None), "vision_config", None)
    names = ("patch_size", "temporal_patch_size", "spatial_merge_size")
    return {n: int(getattr(config, n)) for n in names if getattr(config, n, None) is not None}


def embed_reuse_of(model: nn.Module) -> EmbedReuse | None:
    """The `EmbedReuse` installed on `model` (or its backbone), or None."""
    for owner in (model, getattr(model, "model", None)):
        found = getattr(owner, _ATTRIBUTE, None)
        if isinstance(found, EmbedReuse):
            return found
    return None


def install_embed_reuse(
    model: nn.Module, version: str | None, cache: EmbedCache | None = None, settings: Mapping[str, Any] | None = None
) -> EmbedReuse | None:
    """Route `model`'s tower calls through an `EmbedReuse` (module doc); None for a model it does not serve (no
    Qwen-VL backbone with ``get_video_features``, e.g. an Omni thinker). `version`: the frozen tower's weights
    version (`embed_cache.tower_version`), None for a trained tower."""
    backbone = next(
        (
            m
            for m in (model, getattr(model, "model", None))
            if isinstance(m, nn.Module)
            and isinstance(getattr(m, "visual", None), nn.Module)
            and hasattr(m, "get_video_features")
            and hasattr(m.visual, "spatial_merge_size")
        ),
        None,
    )
    if backbone is None:
        return None
    reuse = EmbedReuse(backbone, version, cache, settings or {})
    # Instance attributes shadow the class's methods: the backbone's own forward calls these
    target: Any = backbone  # the methods are typed on the class; these instance attributes replace them
    target.get_video_features = reuse.features
    target.get_image_features = reuse.features
    setattr(backbone, _ATTRIBUTE, reuse)
    return reuse
