"""Helpers the workers call for vision-language policies (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

How media travels through a batch: every sample carries its own processed media in the non-tensor field
``multi_modal_inputs`` (a dict of tensors: ``pixel_values`` (N_i, D) with the patches of *its* images,
``image_grid_thw`` (n_i, 3), and the ``*_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` equivalents; an
empty dict for a text-only sample). ``Batch.split`` / ``index`` / ``repeat_interleave`` keep that list aligned with
the rows, so a micro-batch selects its patches simply by concatenating its own samples' tensors, in row order
(:func:`multimodal_forward_kwargs`) -- which is the order the ``<|image_pad|>`` runs appear in ``input_ids``.

Position ids are not stored in the batch for VL models: the 3D (M-RoPE) positions are recomputed per micro-batch
from ``input_ids``, the attention mask and the grids (:func:`mrope_position_ids`), using the model's own
``get_rope_index``; response tokens are text, so their positions continue the prompt's. The padding-free layout
(:func:`easyrl.workers.packing.prepare_inputs`) packs them per sample, behind a row of 1D text positions.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from easyrl.models.family import audio_output_tokens, family_of


__all__ = [
    "MEDIA_KEYS",
    "freeze_vision_tower",
    "generate_with_media",
    "is_vision_language",
    "media_token_ids",
    "mm_token_type_ids",
    "model_class_for",
    "mrope_position_ids",
    "multimodal_forward_kwargs",
    "stack_media",
    "vision_tower",
]

MEDIA_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "input_features",
    "feature_attention_mask",
)
"""Keys of a sample's ``multi_modal_inputs`` that are concatenated across samples, in this order (the last two: an
Omni model's audio clips, log-mel features (n, mels, frames) padded to the feature extractor's window and their
frame masks (n, frames))."""


def is_vision_language(config: Any) -> bool:
    """Whether an HF config (or model) is a vision-language model (has a ``vision_config``)."""
    config = getattr(config, "config", config)
    return getattr(config, "vision_config", None) is not None


def model_class_for(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for VL configs, else ``AutoModelForCausalLM`` (which has no VL mapping)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _rope_owner(model_or_config: Any) -> Any:
    """An object with ``config`` and ``get_rope_index``: the model's inner ``*VLModel``, or a stand-in built from a
    config (the methods only read ``self.config`` and call ``self.get_vision_position_ids``)."""
    for candidate in (getattr(model_or_config, "model", None), model_or_config):
        if candidate is not None and hasattr(candidate, "get_rope_index") and hasattr(candidate, "config"):
            return candidate
    config = getattr(model_or_config, "config", model_or_config)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "get_rope_index"):
        raise ValueError(f"{type(model_or_config).__name__}: no get_rope_index for model_type {config.model_type!r}")
    owner = types.SimpleNamespace(config=config)
    # get_rope_index calls it through self
    owner.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, owner)
    owner.get_rope_index = types.MethodType(cls.get_rope_index, owner)
    return owner


def mm_token_type_ids(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """0 for text, 1 for ``<|image_pad|>``, 2 for ``<|video_pad|>`` tokens (what ``get_rope_index`` groups by)."""
    config = getattr(config, "config", config)
    types_ = torch.zeros_like(input_ids, dtype=torch.int)
    types_[input_ids == config.image_token_id] = 1
    types_[input_ids == config.video_token_id] = 2
    return types_


def mrope_position_ids(
    model_or_config: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    feature_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """3D rotary positions (3, B, L) for left-padded prompt+response sequences.

    Uses the model's own ``get_rope_index`` (transformers 5.19: ``model.model.get_rope_index(input_ids,
    mm_token_type_ids, image_grid_thw, video_grid_thw, [second_per_grid_ts,] attention_mask)``). Padding gets 0;
    text tokens after an image continue from ``max(vision positions) + 1``, and response tokens, being text,
    continue the prompt. ``image_grid_thw`` / ``video_grid_thw`` list the media of all rows in row order.

    Args:
        model_or_config: the VL model (FSDP-wrapped is fine) or its HF config.
        input_ids: (B, L) token ids.
        attention_mask: (B, L), 1 for real tokens.
        image_grid_thw: (num_images, 3), or None.
        video_grid_thw: (num_videos, 3), or None.
        second_per_grid_ts: (num_videos,) seconds per temporal patch (Qwen2.5-VL), or None.
        feature_attention_mask: (num_audios, frames) an Omni model's audio frame masks, or None. Audio tokens take
            consecutive positions on all three axes, so rows with audio and no image are text-like here.
    """
    owner = _rope_owner(model_or_config)
    if image_grid_thw is None and video_grid_thw is None:
        # Text only: every component equals the 1D position.
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions.unsqueeze(0).expand(3, -1, -1).clone()  # clone: an expanded view cannot be written in place
    kwargs: dict[str, Any] = {
        "image_grid_thw": image_grid_thw,
        "video_grid_thw": video_grid_thw,
        "attention_mask": attention_mask,
    }
    if family_of(owner.config).thinker:
        # the Omni thinker's own signature: no token types; each audio's length places the tokens after it
        seqlens = None if feature_attention_mask is None else feature_attention_mask.sum(-1)
        position_ids, _ = owner.get_rope_index(
            input_ids, second_per_grids=second_per_grid_ts, audio_seqlens=seqlens, **kwargs
        )
        return position_ids
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    # (3, B, L) positions; the rope deltas are not needed outside generate
    position_ids, _ = owner.get_rope_index(input_ids, mm_token_type_ids(input_ids, owner.config), **kwargs)
    return position_ids


def _encoder(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule `name` of `model` or of its inner ``model`` (where transformers 5 keeps a VL model's parts)."""
    for candidate in (getattr(model, "model", None), model):
        encoder = getattr(candidate, name, None)
        if isinstance(encoder, nn.Module):
            return encoder
    return None


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder (``visual``, with its patch merger) of a VL model, or None for a text model."""
    return _encoder(model, "visual")


def audio_tower(model: nn.Module) -> nn.Module | None:
    """The audio encoder (``audio_tower``) of an Omni thinker, or None."""
    return _encoder(model, "audio_tower")


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop training the vision encoder (merger included); returns how many parameters were frozen.

    Call before sharding and before building the optimizer, so the frozen tensors get no optimizer state.
    A text model is left as is (returns 0).
    """
    visual = vision_tower(model)
    if visual is None:
        return 0
    frozen = 0
    for param in visual.parameters():
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen


def stack_media(samples: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Concatenate the ``multi_modal_inputs`` of ``samples`` (in order) into one set of model inputs.

    Samples without media (None or empty) contribute nothing. Keys missing from every sample are left out.
    """
    out: dict[str, torch.Tensor] = {}
    for key in MEDIA_KEYS:
        parts = [s[key] for s in samples if s and key in s]
        if parts:
            # in row order: the order of the pad runs in input_ids
            out[key] = torch.cat([torch.as_tensor(p) for p in parts], dim=0)
    return out


def multimodal_forward_kwargs(
    batch_slice: Any, model: nn.Module | None = None, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Extra ``model(...)`` arguments for a micro-batch of a VL batch; ``{}`` when it carries no media.

    ``batch_slice`` is a :class:`easyrl.batch.Batch` (or a dict) with ``input_ids``, ``attention_mask`` and the
    per-sample list ``multi_modal_inputs``. Returns ``pixel_values`` / ``image_grid_thw`` (and the video
    equivalents) for exactly these rows and, when ``model`` is given, ``position_ids`` (3, b, L) from
    :func:`mrope_position_ids`, which replace the batch's 1D positions, and ``mm_token_type_ids`` (Qwen3-VL
    insists on it whenever grids are passed). Everything is moved to ``device``.
    """
    if "multi_modal_inputs" not in batch_slice:
        return {}
    media = stack_media(batch_slice["multi_modal_inputs"])
    if not media:
        return {}
    kwargs: dict[str, Any] = dict(media)
    if model is not None:
        _check_media_tokens(batch_slice["input_ids"], model.config, media)
        kwargs["position_ids"] = mrope_position_ids(
            model,
            batch_slice["input_ids"],
            batch_slice["attention_mask"],
            media.get("image_grid_thw"),
            media.get("video_grid_thw"),
            media.get("second_per_grid_ts"),
            media.get("feature_attention_mask"),
        )
        if family_of(model).mm_token_types:  # the Omni thinker takes none (they would reach its attention as kwargs)
            kwargs["mm_token_type_ids"] = mm_token_type_ids(batch_slice["input_ids"], model.config)
    if device is not None:
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
    # The processor's patches (and mel features) are fp32; the towers' first layers take their weights' dtype.
    if model is not None:
        for key in ("pixel_values", "pixel_values_videos", "input_features"):
            if key in kwargs:
                kwargs[key] = kwargs[key].to(_param_dtype(model))
    return kwargs


def _check_media_tokens(input_ids: torch.Tensor, config: Any, media: dict[str, torch.Tensor]) -> None:
    """Raise a readable error when the pad tokens in ``input_ids`` do not match the media's patch counts."""
    config = getattr(config, "config", config)
    media_family = family_of(config).media
    if "feature_attention_mask" in media and media_family is not None:
        # the processor family's audio arithmetic
        expected = int(audio_output_tokens(media["feature_attention_mask"].sum(-1), media_family.name).sum())
        found = int((input_ids == config.audio_token_id).sum())
        if found != expected:
            raise ValueError(
                f"{found} audio_token_id tokens in the micro-batch but its audio clips make {expected}: a prompt was "
                "truncated, or a response contains audio special tokens (the rollout must never sample them)"
            )
    merge = int(config.vision_config.spatial_merge_size) ** 2
    for token_key, grid_key in (("image_token_id", "image_grid_thw"), ("video_token_id", "video_grid_thw")):
        # one pad per merged patch: t * h * w / merge_size**2
        expected = int(media[grid_key].prod(dim=-1).sum()) // merge if grid_key in media else 0
        found = int((input_ids == getattr(config, token_key)).sum())
        if found != expected:
            raise ValueError(
                f"{found} {token_key} tokens in the micro-batch but its media have {expected} patches: a prompt was "
                "truncated, or a response contains vision special tokens (the rollout must never sample them)"
            )


def _param_dtype(model: nn.Module) -> torch.dtype:
    visual = vision_tower(model)
    for param in (visual if visual is not None else model).parameters():
        return param.dtype
    return torch.float32


@torch.no_grad()
def generate_with_media(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Sequence[dict[str, torch.Tensor] | None] | None,
    encoder_outputs: dict[str, Any] | None = None,
    **generate_kwargs: Any,
) -> Any:
    """``model.generate`` for left-padded prompts whose rows carry media (one dict per row, already repeated for
    ``n`` samples per prompt). Text-only batches go straight to ``generate``.

    Passes ``pixel_values`` / grids and ``mm_token_type_ids`` (without which the model cannot build its 3D
    positions), and clears the model's cached ``rope_deltas`` afterwards so later forwards start clean. The vision
    special tokens are never sampled: a ``<|image_pad|>`` in a response would be taken for an image slot by every
    later forward pass ("Image features and image tokens do not match").

    ``encoder_outputs``: the vision tower's outputs of some media kinds (``{"image" | "video": TowerFeatures}``,
    `easyrl.rollout.media_embeds`), passed as transformers' ``mm_encoder_outputs`` in place of those kinds' pixels:
    the model scatters them into the prompt's embeddings without running its tower; the grids still go in, so the
    3D positions come from the token ids and grids as with pixels.
    """
    media = stack_media(list(multi_modal_inputs or []))
    device = input_ids.device
    generate_kwargs = _suppress_media_tokens(model.config, generate_kwargs)
    taken = {"image": "pixel_values", "video": "pixel_values_videos"}
    skip = {taken[kind] for kind in encoder_outputs or {}}
    extra: dict[str, Any] = {k: v.to(device) for k, v in media.items() if k not in skip}
    if encoder_outputs:
        extra["mm_encoder_outputs"] = dict(encoder_outputs)  # generate adds the kinds it encodes to this dict
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in extra:
            extra[key] = extra[key].to(_param_dtype(model))
    if media and family_of(model).mm_token_types:
        extra["mm_token_type_ids"] = mm_token_type_ids(input_ids, model.config)
    try:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **extra, **generate_kwargs)
    finally:
        # generate caches per-row rope offsets for its decode steps; a later pass with a KV cache or embeddings
        # only would apply them to other rows (the Omni thinker keeps them on itself, the VL models inside)
        for owner in (getattr(model, "model", None), model):
            if owner is not None and hasattr(owner, "rope_deltas"):
                owner.rope_deltas = None


def media_token_ids(config: Any) -> list[int]:
    """Ids of the media special tokens (image/video pads, vision start/end; an Omni model's audio pad, start and end)
    of a VL config; [] for text models."""
    config = getattr(config, "config", config)
    names: tuple[str, ...] = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    media = family_of(config).media
    if media is not None and media.takes_audio:
        names += ("audio_token_id", "audio_start_token_id", "audio_end_token_id")
    return [int(v) for v in (getattr(config, n, None) for n in names) if v is not None]


def _suppress_media_tokens(config: Any, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate_kwargs`` with the vision special tokens added to ``suppress_tokens``."""
    ids = media_token_ids(config)
    if not ids:
        return generate_kwargs
    kwargs = dict(generate_kwargs)
    gen_cfg = kwargs.get("generation_config")
    if gen_cfg is not None:
        gen_cfg = copy.deepcopy(gen_cfg)  # the caller's config stays untouched
        gen_cfg.suppress_tokens = sorted(set(gen_cfg.suppress_tokens or []) | set(ids))
        kwargs["generation_config"] = gen_cfg
    else:
        kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens") or []) | set(ids))
    return kwargs
