"""`easyrl merge` for a diffusion run: the actor's checkpoint of the denoiser -> a diffusers pipeline folder.

The actor of a diffusion run trains only the pipeline's denoiser (``transformer``): its checkpoint holds that
module's state dict under diffusers' own names, sharded as any actor's (`easyrl.checkpoint.sharded`), or under LoRA
the adapters alone plus ``lora.json``. Rank 0 also writes ``<role>/huggingface/pipeline.json`` naming the base
pipeline folder (`write_pipeline_files`), which is how a checkpoint says it is a denoiser's.

The merge writes a folder `DiffusionPipeline.from_pretrained` loads: every component of the base pipeline but the
denoiser is hard-linked from the base folder (copied where the file system cannot link: the text encoders of SD3 are
~10 GB that training never changed), and ``transformer/`` holds the trained weights (the base plus ``alpha / rank *
B @ A`` under LoRA) in diffusers' file names, split with an index past the shard size.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.sharded import ShardedReader
from easyrl.checkpoint.worker import HF_DIR, MERGE_MARKER


logger = logging.getLogger(__name__)

PIPELINE_FILE = "pipeline.json"
"""In ``<role>/huggingface/`` of a denoiser's checkpoint: the base pipeline folder and the trained component."""
WEIGHTS = "diffusion_pytorch_model"
"""diffusers' file name of a model's weights (``.safetensors``, or ``-0000i-of-0000n.safetensors`` + index)."""


def write_pipeline_files(
    folder: str, transformer: nn.Module, pipeline_path: str, component: str = "transformer"
) -> None:
    """Rank 0's side files of a denoiser checkpoint in `folder` (``<role>/huggingface``): the component's diffusers
    config (``config.json``) and `PIPELINE_FILE`."""
    fsio.makedirs(folder)
    to_json = getattr(transformer, "to_json_string", None)  # diffusers' ConfigMixin; FSDP2 keeps the method
    if callable(to_json):
        fsio.write_bytes(os.path.join(folder, "config.json"), str(to_json()).encode("utf-8"))
    fsio.write_json(
        os.path.join(folder, PIPELINE_FILE), {"base_pipeline": os.path.abspath(pipeline_path), "component": component}
    )


def pipeline_source(
    role_folder: str, base_model: str | None, lora: dict | None, run_config: dict | None = None
) -> tuple[str, str] | None:
    """(base pipeline folder, trained component) when `role_folder` holds a denoiser, else None (an LLM's). The base
    is, first found: `base_model`, the LoRA record's, `PIPELINE_FILE`'s, the run config's actor model path."""
    from easyrl.config.diffusion import is_diffusion_pipeline

    path = os.path.join(role_folder, HF_DIR, PIPELINE_FILE)
    info = fsio.read_json(path) if os.path.isfile(path) else {}
    if not isinstance(info, dict):
        raise CheckpointError(f"{path} does not hold a mapping")
    actor = ((run_config or {}).get("worker") or {}).get("actor") or {}
    from_run = (actor.get("model") or {}).get("model_path")
    base = base_model or (lora or {}).get("base_model") or info.get("base_pipeline") or from_run
    if not info and not (base and is_diffusion_pipeline(str(base))):
        return None
    if not base or not is_diffusion_pipeline(str(base)):
        raise CheckpointError(
            f"{role_folder} holds a denoiser but its base pipeline {base} has no model_index.json: pass the pipeline "
            "folder with --base-model"
        )
    return os.path.abspath(str(base)), str(info.get("component", "transformer"))


def _load_component(folder: str) -> nn.Module:
    import diffusers

    config = fsio.read_json(os.path.join(folder, "config.json"))
    name = config.get("_class_name") if isinstance(config, dict) else None
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise CheckpointError(f"{folder}/config.json names {name!r}, which diffusers {diffusers.__version__} lacks")
    model = cls.from_pretrained(folder)
    assert isinstance(model, nn.Module)
    return model


def _tensors(
    reader: ShardedReader, lora: dict | None, base_dir: str
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names, name -> full tensor) of the trained denoiser: the checkpoint's, or the base folded with the adapters."""
    if lora is None:
        names = reader.names() + [a for a in reader.aliases if a not in reader.infos]
        return names, lambda n: reader.full_tensor(reader.aliases.get(n, n) if n not in reader.infos else n)
    from easyrl.lora_merge import fold_adapters

    state = _load_component(base_dir).state_dict()
    scale = fold_adapters(reader, lora, state, base_dir)
    logger.info("folded %d adapters (scale %g) into %s", len(lora["modules"]), scale, base_dir)
    return list(state), lambda n: state[n]


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.isdir(src):
        fsio.makedirs(dst)
        for entry in sorted(os.listdir(src)):
            _link_or_copy(os.path.join(src, entry), os.path.join(dst, entry))
        return
    try:
        os.link(os.path.realpath(src), dst)  # the hub cache's files are links to blobs: link the blob
    except OSError:  # another file system, or links not allowed
        fsio.copy_file(src, dst)


def merge_pipeline(
    role_folder: str,
    out: str,
    base: str,
    component: str,
    lora: dict | None,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
) -> str:
    """Write the merged pipeline folder at `out` (atomically, with the merge marker) and return it."""
    reader = ShardedReader(role_folder)
    base_component = os.path.join(base, component)
    if not os.path.isdir(base_component):
        raise CheckpointError(f"the base pipeline {base} has no {component}/ folder to replace")
    names, tensor_of = _tensors(reader, lora, base_component)
    trained_cfg = os.path.join(role_folder, HF_DIR, "config.json")
    with fsio.folder_replaced_atomically(out) as tmp:
        for entry in sorted(os.listdir(base)):
            if entry != component and not entry.startswith("."):
                _link_or_copy(os.path.join(base, entry), os.path.join(tmp, entry))
        target = os.path.join(tmp, component)
        fsio.makedirs(target)
        config_src = trained_cfg if os.path.isfile(trained_cfg) else os.path.join(base_component, "config.json")
        fsio.copy_file(config_src, os.path.join(target, "config.json"))
        shards, total = _write_shards(target, names, tensor_of, dtype, max_shard_bytes)
        fsio.write_json(os.path.join(tmp, MERGE_MARKER), {"source": role_folder, "tensors": len(names), "base": base})
    logger.info("merged %d tensors (%d files, %.1f MiB) of %s over %s into %s", len(names), shards, total / 2**20,
                component, base, out)  # fmt: skip
    return out


def _write_shards(
    folder: str,
    names: list[str],
    tensor_of: Callable[[str], torch.Tensor],
    dtype: torch.dtype | None,
    max_shard_bytes: int,
) -> tuple[int, int]:
    """Write the tensors under diffusers' file names; (files written, bytes)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes, total = [0], 0
    for name in names:
        tensor = tensor_of(name).detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + size > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.contiguous()
        sizes[-1] += size
        total += size
    if len(shards) == 1:
        fsio.save_tensors(os.path.join(folder, f"{WEIGHTS}.safetensors"), shards[0], {"format": "pt"})
        return 1, total
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"{WEIGHTS}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        fsio.save_tensors(os.path.join(folder, file), part, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fsio.write_bytes(os.path.join(folder, f"{WEIGHTS}.safetensors.index.json"), json.dumps(index, indent=2).encode())
    return len(shards), total
