"""`easyrl merge` for LoRA checkpoints: the base model plus the adapters, or the adapters as a PEFT folder.

A LoRA policy's checkpoint holds only its adapters (`<module>.lora_A.default.weight`, `...lora_B...`), its
optimizer and `lora.json` (rank, alpha, adapted modules, base model folder). Merging loads the base model the way
training did, adds `alpha / rank * B @ A` to each adapted weight, and hands the tensors to the ordinary merge writer.
`--adapter-only` writes `adapter_config.json` + `adapter_model.safetensors` in PEFT's layout instead (keys
`base_model.model.<module>.lora_A.weight`), which `peft.PeftModel.from_pretrained` and vLLM's LoRA support load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.sharded import ShardedReader, model_tensors
from easyrl.checkpoint.worker import LORA_FILE, MERGE_MARKER, TOKENIZER_FILES
from easyrl.workers.lora import ADAPTER


logger = logging.getLogger(__name__)


def adapter_info(role_folder: str) -> dict[str, Any] | None:
    """The checkpoint's `lora.json` (None: a full-weight checkpoint), checked for what the merge needs."""
    path = os.path.join(role_folder, LORA_FILE)
    if not os.path.isfile(path):
        return None
    info = fsio.read_json(path)
    missing = [k for k in ("rank", "alpha", "modules", "base_model") if not isinstance(info, dict) or k not in info]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}")
    assert isinstance(info, dict)
    return info


def _pair(reader: ShardedReader, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    names = [f"{module}.lora_{part}.{ADAPTER}.weight" for part in ("A", "B")]
    absent = [n for n in names if n not in reader.infos]
    if absent:
        raise CheckpointError(f"{reader.folder}: lora.json names {module} but its shards lack {absent}")
    return reader.full_tensor(names[0]), reader.full_tensor(names[1])


@torch.no_grad()
def fold_adapters(
    reader: ShardedReader, info: dict[str, Any], weights: dict[str, torch.Tensor], base_dir: str
) -> float:
    """Add each adapted module's B @ A x alpha / rank into its base weight in `weights` (in place); a module the base
    lacks is one `CheckpointError`. Returns the scale. LLMs and diffusion denoisers fold the same way."""
    scale = float(info["alpha"]) / float(info["rank"])
    for module in info["modules"]:
        weight = weights.get(f"{module}.weight")
        if weight is None:
            raise CheckpointError(f"{reader.folder}: adapted module {module} has no weight in {base_dir}")
        a, b = _pair(reader, module)
        weight.add_((b.float() @ a.float()).to(weight.dtype) * scale)
    return scale


def merged_source(
    reader: ShardedReader, info: dict[str, Any], tied: bool
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(tensor names, name -> merged full tensor) of the base model with the adapters folded in."""
    from easyrl.config.worker import ModelConfig
    from easyrl.workers.model_setup import load_model

    base_dir = str(info["base_model"])
    if not os.path.isdir(base_dir):
        raise CheckpointError(
            f"the base model folder {base_dir} (from {reader.folder}/{LORA_FILE}, or --base-model) does not exist: "
            "pass the base model's folder with --base-model"
        )
    model = load_model(ModelConfig(model_path=base_dir, enable_gradient_checkpointing=False))
    tensors, aliases = model_tensors(model)
    scale = fold_adapters(reader, info, tensors, base_dir)
    names = list(tensors) + ([] if tied else [a for a in aliases if a not in tensors])
    logger.info(
        "folded %d adapters (scale %g) into the base model read from %s", len(info["modules"]), scale, base_dir
    )
    return names, lambda name: tensors[aliases.get(name, name)].detach()


def write_adapter_folder(reader: ShardedReader, info: dict[str, Any], hf_src: str, out: str, source: str) -> str:
    """Write the PEFT adapter folder of a LoRA checkpoint at `out` (atomically, with the merge marker)."""
    from easyrl.workers.lora import peft_adapter

    modules = list(info["modules"])
    pairs = {module: _pair(reader, module) for module in modules}
    rank, alpha, dropout = info["rank"], info["alpha"], float(info.get("dropout", 0.0))
    tensors, config = peft_adapter(pairs, rank, alpha, dropout, str(info["base_model"]))
    with fsio.folder_replaced_atomically(out) as tmp:
        fsio.save_tensors(os.path.join(tmp, "adapter_model.safetensors"), tensors, {"format": "pt"})
        fsio.write_json(os.path.join(tmp, "adapter_config.json"), config)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_src, name)):
                fsio.copy_file(os.path.join(hf_src, name), os.path.join(tmp, name))
        fsio.write_json(os.path.join(tmp, MERGE_MARKER), {"source": source, "tensors": len(tensors), "adapter": True})
    logger.info("wrote the LoRA adapter of %d modules from %s into %s", len(modules), source, out)
    return out
