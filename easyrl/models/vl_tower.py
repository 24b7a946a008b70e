"""Every forward of a vision-language model runs its vision tower, also on a micro-batch without images or videos.

The tower is FSDP2-sharded like the rest of the model: its blocks are units of their own and its other parameters
(patch embedding, merger, Qwen3-VL's deepstack mergers) belong to the root unit. A Qwen-VL forward calls the tower
once for its images and once for its videos, each call gathering every block's parameters (and scattering their
gradients in the backward). So when data-parallel ranks' micro-batches differ in media (text-only rows mixed with
image rows, a text-only dummy micro-batch, images on one rank and images plus a video on another), their all-gathers
and reduce-scatters stop pairing up (gloo aborts with "Received data size doesn't match expected size") and root-unit
vision parameters get a gradient on one rank and none on the other.

:func:`keep_vision_tower_in_step` closes that. When the backbone is entered, the ranks agree (one all-reduce of two
flags, before any tower call) on which media kinds some rank's micro-batch carries; when the language model is
entered, every rank has called the tower once per such kind: each missing call runs on a minimal dummy grid (one
merged token of zero patches) and ``0.0 * (sum of its outputs)``, deepstack outputs included, is added to
``inputs_embeds``. The values are unchanged; every vision parameter gets a gradient (zero where no media) on every
rank; the collectives pair up. The dummy runs inside the model's own forward, where FSDP's root pre-forward has
already gathered the root unit's parameters. A kind that no rank carries costs nothing: an image-only run no longer
runs the tower a second time for videos in every micro-batch (under FSDP each tower call all-gathers the whole tower
and reduce-scatters its gradients: ~1.3 GB in bf16 for Qwen2.5-VL-3B), and when no rank has any media, each rank adds
``0.0 * (sum of its local vision parameters)`` instead: zero gradients without a collective.

A rank whose media are all reused or cached (`easyrl.models.vl_embeds`) makes no call of its own for that kind: the
dummy call stands in for it, as for a micro-batch without media.

An Omni thinker's audio tower is kept in step the same way, as a tower of its own: one more flag in the same
all-reduce (``input_features``), and a missing call runs on four zero mel frames (one audio token).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from easyrl.models.vision import audio_tower, vision_tower
from easyrl.models.vl_sequence import language_model


__all__ = ["TOWER_CALLS", "entering_backbone", "keep_vision_tower_in_step"]

TOWER_CALLS = 2
"""Vision tower calls of one Qwen-VL forward with both media kinds: the images, then the videos."""
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos")
"""The backbone's inputs of each media kind, one tower call each."""
AUDIO_INPUTS = ("input_features",)
"""An Omni thinker's audio input: one audio-tower call."""


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a vision tower's output (a tensor, a model output, nested tuples/lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict of its non-None fields
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for item in out for t in _tensors(item)]
    return []


def _dummy_tower_term(visual: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """0-d zero wired to every output of `visual` run on one merged token's worth of zero patches."""
    tower: Any = visual
    merge = int(tower.config.spatial_merge_size)
    # the patch embedding's Conv3d weight is (hidden, channels, temporal patch, patch, patch): one flattened patch
    patch_dim = math.prod(tower.patch_embed.proj.weight.shape[1:])
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    pixels = torch.zeros(merge * merge, patch_dim, device=like.device, dtype=like.dtype)
    outputs = [t.float().sum() for t in _tensors(visual(pixels, grid_thw=grid)) if t.is_floating_point()]
    return (0.0 * torch.stack(outputs).sum()).to(like.dtype)


def _dummy_audio_term(audio: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """0-d zero wired to the output of an Omni audio tower run on four zero mel frames (one output token)."""
    tower: Any = audio
    frames = torch.zeros(int(tower.num_mel_bins), 4, device=like.device, dtype=like.dtype)
    lens = torch.tensor([4], device=like.device)
    # Qwen2.5-Omni's tower takes the post-conv lengths too; Qwen3-Omni's works them out itself
    extra = (
        {"aftercnn_lens": (lens - 1) // 2 + 1}
        if "aftercnn_lens" in inspect.signature(audio.forward).parameters
        else {}
    )
    out = audio(frames, feature_lens=lens, **extra)
    outputs = [t.float().sum() for t in _tensors(out) if t.is_floating_point()]
    return (0.0 * torch.stack(outputs).sum()).to(like.dtype)


def _zero_parameter_term(visual: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """0-d zero wired to every trainable parameter of `visual`, from each rank's own shard (no collective): a tower
    unit that did not run holds its sharded DTensor parameters, whose local part takes the (zero) gradient."""
    total = torch.zeros((), device=like.device, dtype=torch.float32)
    for param in visual.parameters():
        if param.requires_grad:
            local = param.to_local() if isinstance(param, DTensor) else param
            total = total + local.float().sum()
    return (0.0 * total).to(like.dtype)


def _kinds_in_step(kwargs: dict[str, Any], inputs: list[tuple[str, ...]]) -> list[int]:
    """Per tower (its input names in `inputs`), how many of its media kinds some rank's micro-batch carries (the
    calls every rank must make); one all-reduce of the flags when distributed, which every rank reaches before any
    tower call."""
    keys = [k for names in inputs for k in names]
    flags = [int(isinstance(kwargs.get(k), torch.Tensor) and kwargs[k].numel() > 0) for k in keys]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        agreed = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        flags = [int(f) for f in agreed.tolist()]
    counts, start = [], 0
    for names in inputs:
        counts.append(sum(flags[start : start + len(names)]))
        start += len(names)
    return counts


def _backbone(model: nn.Module) -> nn.Module:
    """The module holding the vision tower and the language model (``Qwen*VLModel``): every forward path enters it,
    also the fused head's, which calls it from a method of its own rather than through the top-level ``forward``."""
    for owner in (model, getattr(model, "model", None)):
        if isinstance(owner, nn.Module) and isinstance(getattr(owner, "visual", None), nn.Module):
            return owner
    raise ValueError(f"{type(model).__name__} has no vision tower (visual): not a Qwen-VL style model")


_ENTRY = "_easyrl_towers_entry"
"""The backbone's attribute holding what its forward pre-hook runs (the ranks' agreement on the media kinds)."""


def entering_backbone(backbone: nn.Module, kwargs: dict[str, Any]) -> None:
    """What entering `backbone` (a module whose forward calls the towers) runs before its forward, for a caller that
    calls ``backbone.forward`` directly rather than the module (the fused head on an Omni thinker, whose own module
    call would go through FSDP2's root hooks a second time): the ranks agree on the media kinds of this forward. A
    no-op where `keep_vision_tower_in_step` installed nothing."""
    entry = getattr(backbone, _ENTRY, None)
    if entry is not None:
        entry(backbone, (), kwargs)


def keep_vision_tower_in_step(model: nn.Module) -> None:
    """Install (once, at sharding time) the hooks that run `model`'s vision tower (and an Omni thinker's audio tower)
    on every forward (module doc)."""
    backbone = _backbone(model)
    visual = vision_tower(backbone)
    assert visual is not None
    lm: Any = language_model(backbone)
    towers: list[tuple[nn.Module, tuple[str, ...], Any]] = [(visual, MEDIA_INPUTS, _dummy_tower_term)]
    audio = audio_tower(backbone)
    if audio is not None:
        towers.append((audio, AUDIO_INPUTS, _dummy_audio_term))
    calls = [0] * len(towers)  # each tower's calls in the current forward
    needed = [len(names) for _, names, _ in towers]  # the calls every rank makes (agreed when the forward starts)

    def reset(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        calls[:] = [0] * len(towers)
        needed[:] = _kinds_in_step(kwargs, [names for _, names, _ in towers])

    def counter(i: int) -> Any:
        def count(module: nn.Module, args: Any, out: Any) -> None:
            calls[i] += 1

        return count

    def ensure(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        embeds = kwargs.get("inputs_embeds")
        if not isinstance(embeds, torch.Tensor):
            calls[:] = [0] * len(towers)
            return args, kwargs
        changed = False
        for i, (tower, _, dummy) in enumerate(towers):
            missing = needed[i] - calls[i]
            for _ in range(missing):
                embeds = embeds + dummy(tower, embeds)
            if needed[i] == 0:  # no rank runs the tower: zero gradients for its parameters, from the local shards
                embeds = embeds + _zero_parameter_term(tower, embeds)
            changed = changed or missing > 0 or needed[i] == 0
        calls[:] = [0] * len(towers)  # consumed (the dummy calls counted too): the next forward counts afresh
        return args, (dict(kwargs, inputs_embeds=embeds) if changed else kwargs)

    backbone.register_forward_pre_hook(reset, with_kwargs=True)
    setattr(backbone, _ENTRY, reset)  # for a caller that runs the backbone's `forward` itself (`entering_backbone`)
    for i, (tower, _, _) in enumerate(towers):
        tower.register_forward_hook(counter(i))
    # prepend: the term joins the whole row before a sequence-parallel split (vl_sequence) slices it
    lm.register_forward_pre_hook(ensure, with_kwargs=True, prepend=True)
