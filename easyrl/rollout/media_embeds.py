"""Vision-tower outputs handed to a rollout engine in place of pixels, so the engine does not encode them again.

The actor encodes every image and video once per step and reuses the encoding across its passes
(`easyrl.models.vl_embeds`); with a frozen tower that encoding is also kept in a process-wide memo and in the disk
cache (`data.cache_dir`, filled ahead by `easyrl cache-embeds`). An engine in the actor's process (the HybridEngine)
looks each of a prompt's items up there (`EmbedReuse.lookup`) and, when every item of a kind is held, takes the
tower outputs instead of the pixels:

* the HF engine passes them as transformers' ``mm_encoder_outputs`` (the model scatters them into its token
  embeddings itself; the grids still go in, so the 3D positions are built from the token ids as with pixels);
* the vLLM engine passes ``{"image_embeds" | "video_embeds", "*_grid_thw"}`` dicts in ``multi_modal_data``
  (vLLM's embedding inputs, ``enable_mm_embeds``), for the families whose embedding route it serves exactly
  (`FamilyProfile.vllm_embeds`: Qwen2.5-VL).

When does the engine take pixels? The tower is trained (its held outputs are of an earlier step: stale), the
engine runs in a process without the actor (`worker.rollout.placement: separate`), the family has no embedding
route, or an item was never encoded yet (the first epoch without `easyrl cache-embeds`). Each reason is logged
once, never silently, and every call counts its items (`perf/rollout_items_as_embeds`, `perf/rollout_items_as_pixels`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch


__all__ = [
    "MEDIA_KINDS",
    "NOT_HELD",
    "EmbedLookup",
    "MediaEmbeds",
    "batch_outputs",
    "row_embeds",
]

logger = logging.getLogger(__name__)

MEDIA_KINDS = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))
"""(kind, patches key, grid key) of each media kind in a row's ``multi_modal_inputs``."""
NOT_HELD = "an item the actor has not encoded yet (the first epoch: `easyrl cache-embeds` fills data.cache_dir ahead)"


class EmbedLookup(Protocol):
    """Where held tower outputs come from (`easyrl.models.vl_embeds.EmbedReuse`)."""

    version: str | None

    def lookup(self, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor] | None: ...


class MediaEmbeds:
    """One engine's source of tower outputs and its counts. `why_not`: the reason every item goes as pixels (the
    source is None or its tower is trained), logged once."""

    def __init__(self, source: EmbedLookup | None, why_not: str | None = None) -> None:
        if source is not None and source.version is None:
            source, why_not = None, "the vision tower is trained (its held outputs would be a step stale)"
        self.source = source
        self.why_not = why_not or "no actor encodings in this process"
        self.as_embeds = 0
        """Media items the engine received as tower outputs."""
        self.as_pixels = 0
        """Media items the engine received as pixels (and encoded with its own tower)."""
        self._said: set[str] = set()
        self._seen = (0, 0)

    def kind_outputs(self, media: dict[str, torch.Tensor] | None, kind: str) -> list[list[torch.Tensor]] | None:
        """The held outputs of every `kind` item of one row's (or stacked rows') media, item by item; None when
        any is not held (then the caller sends that kind's pixels and calls `pixels`). [] when there are none."""
        patches, grids = _kind_tensors(media, kind)
        if patches is None or grids is None:
            return []
        if self.source is None:
            return None
        found = []
        for pixels, grid in zip(patches.split(grids.prod(-1).tolist()), grids):
            hit = self.source.lookup(pixels, grid)
            if hit is None:
                return None
            found.append(hit)
        return found

    def took_embeds(self, items: int) -> None:
        self.as_embeds += items

    def pixels(self, items: int, why: str | None = None) -> None:
        """Count `items` sent as pixels; say why once per reason."""
        if items == 0:
            return
        self.as_pixels += items
        reason = why or (self.why_not if self.source is None else NOT_HELD)
        if reason not in self._said:
            self._said.add(reason)
            logger.info("rollout: media go to the engine as pixels (it encodes them itself): %s", reason)

    def counts(self) -> dict[str, int]:
        """Items sent each way since the last call."""
        last = self._seen
        self._seen = (self.as_embeds, self.as_pixels)
        return {
            "perf/rollout_items_as_embeds": self.as_embeds - last[0],
            "perf/rollout_items_as_pixels": self.as_pixels - last[1],
        }


def _kind_tensors(media: dict[str, Any] | None, kind: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(patches, grids) of `kind` in `media`, or (None, None)."""
    for name, patches, grids in MEDIA_KINDS:
        if name == kind and media and patches in media and grids in media:
            return torch.as_tensor(media[patches]), torch.as_tensor(media[grids])
    return None, None


def item_count(media: dict[str, Any] | None, kind: str) -> int:
    """How many `kind` items `media` holds."""
    _, grids = _kind_tensors(media, kind)
    return 0 if grids is None else int(grids.shape[0])


def batch_outputs(
    embeds: MediaEmbeds | None,
    rows: list[dict[str, Any] | None],
    repeat: int,
    why_not: str | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """transformers' ``mm_encoder_outputs`` for a generate call over `rows` (one media dict per prompt), each row
    repeated `repeat` times in place (its n samples): for each kind whose items are all held, a `TowerFeatures`
    (one tensor per item, in the order of the pad runs). A kind not all held goes as pixels (counted). `why_not`:
    the model takes no pre-encoded media at all. The outputs are moved to `device` (held ones live on the host)."""
    from easyrl.models.vl_embeds import TowerFeatures

    out: dict[str, Any] = {}
    for kind, _, _ in MEDIA_KINDS:
        items = sum(item_count(m, kind) for m in rows)
        if items == 0 or embeds is None:
            continue
        if why_not is not None:
            embeds.pixels(items, why_not)
            continue
        per_row = [embeds.kind_outputs(m, kind) for m in rows]
        if any(found is None for found in per_row):
            embeds.pixels(items)
            continue
        held = [[[t.to(device) for t in item] for item in found or []] for found in per_row]
        flat = [item for found in held for _ in range(repeat) for item in found]  # row p's samples: p*n .. p*n+n-1
        deep = len(flat[0]) - 1
        out[kind] = TowerFeatures(
            tuple(item[0] for item in flat),
            [tuple(item[1 + i] for item in flat) for i in range(deep)] if deep else None,
        )
        embeds.took_embeds(items)
    return out


def row_embeds(
    embeds: MediaEmbeds | None, media: dict[str, Any] | None, why_not: str | None = None
) -> dict[str, dict[str, torch.Tensor]] | None:
    """vLLM's embedding inputs for one prompt's media when every item is held: per kind present,
    ``{"<kind>_embeds": (tokens, H) of its items in order, "<kind>_grid_thw": (items, 3)}``. None: the row goes as
    pixels (counted; `why_not` says why when the row cannot take embeddings at all). {}: no media."""
    counts = {kind: item_count(media, kind) for kind, _, _ in MEDIA_KINDS}
    total = sum(counts.values())
    if total == 0 or embeds is None:
        return {} if total == 0 else None
    if why_not is not None:
        embeds.pixels(total, why_not)
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind, _, grid_key in MEDIA_KINDS:
        if counts[kind] == 0:
            continue
        found = embeds.kind_outputs(media, kind)
        if found is None:
            embeds.pixels(total)
            return None
        if any(len(item) > 1 for item in found):  # deepstack outputs: vLLM wants them concatenated (not wired)
            embeds.pixels(total, "the tower has deepstack outputs")
            return None
        assert media is not None
        out[kind] = {
            f"{kind}_embeds": torch.cat([item[0] for item in found]),
            f"{kind}_grid_thw": torch.as_tensor(media[grid_key]),
        }
    embeds.took_embeds(total)
    return out
