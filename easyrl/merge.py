"""`easyrl merge CHECKPOINT [--output DIR] [--dtype bf16|fp16|fp32]`: sharded checkpoint -> Hugging Face folder.

CHECKPOINT is a `global_step_<N>` folder (the `actor` role is merged; `--role critic` for the critic) or one of
its role subfolders; EasyR1's spelling `--local_dir <ckpt>/global_step_<N>/actor` names it too. The checkpoint must
be complete and intact: every file listed in its `COMPLETE` manifest is present with its size and SHA-256
(`--no-verify` skips the hashing for very large checkpoints, and says so). The full tensors are reassembled from
however many `model_rank*_of*.safetensors` files the run wrote, converted to `--dtype` (default: the dtype in the
saved `config.json`), and written as safetensors (split into several files with an index past
`--max-shard-size-gb`) next to the saved config, generation config and tokenizer. The default output is
`<role folder>/huggingface_merged` (EasyR1's merger writes into `<role folder>/huggingface`, which here keeps the
config and tokenizer the merge starts from); the last line printed names the folder. Only JSON and safetensors are
read. Tensors are written in the layout of the model's own checkpoints (a MoE model's experts one matrix each, not
the fused tensors transformers holds in memory: `easyrl.models.weight_layout`).

The output may not be the checkpoint, hold it, or sit anywhere else in the run folder (the folder holding the
`global_step_*` folders): a merge must never replace or mix with what training wrote. Every merge output carries an
`easyrl_merged.json` marker, and `--overwrite` replaces only a folder that has it.

A LoRA checkpoint holds the adapters alone (and `lora.json`): the merge reads its base model from the folder
`lora.json` names and writes base + scale * B @ A, or with `--adapter-only` a PEFT adapter folder.

A diffusion run's checkpoint (its denoiser's) merges into a diffusers pipeline folder instead
(`easyrl.diffusion.merge`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch

from easyrl import lora_merge
from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.manager import MANIFEST, read_run_config, verify_checkpoint
from easyrl.checkpoint.sharded import ShardedReader
from easyrl.checkpoint.worker import HF_DIR, MERGE_MARKER
from easyrl.diffusion.merge import merge_pipeline, pipeline_source
from easyrl.models.dtypes import DTYPES


logger = logging.getLogger(__name__)

_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_HF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
DEFAULT_OUTPUT = "huggingface_merged"


def resolve_role_folder(checkpoint: str, role: str = "actor", verify: bool = True) -> tuple[str, str]:
    """(the global_step folder, the role folder) for a `global_step_<N>` folder or one of its role subfolders,
    verified against its manifest (`verify=False`: sizes and steps only)."""
    # Only the step folder is verified below, so the role must name a folder inside it: a path here (`../x`,
    # `/elsewhere`) would read files no manifest vouches for.
    if role in ("", ".", "..") or "/" in role or (os.altsep and os.altsep in role) or "\0" in role:
        raise CheckpointError(
            f"--role {role!r} is not a role name: give the plain name of a subfolder of the checkpoint "
            "(actor, or critic), no path"
        )
    path = os.path.abspath(checkpoint)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist")
    if os.path.isfile(os.path.join(path, "meta.json")) and not os.path.isfile(os.path.join(path, MANIFEST)):
        step_folder, role_folder = os.path.dirname(path), path
    else:
        step_folder, role_folder = path, os.path.join(path, role)
    if not verify:
        logger.warning(
            "--no-verify: the checksums of %s are not verified (file sizes and steps still are)", step_folder
        )
    verify_checkpoint(step_folder, checksums=verify)
    if not os.path.isdir(role_folder):
        raise CheckpointError(f"{step_folder} has no {os.path.basename(role_folder)!r} folder")
    if os.path.dirname(os.path.realpath(role_folder)) != os.path.realpath(step_folder):
        raise CheckpointError(f"{role_folder} is a link out of {step_folder}: its files were not verified")
    return step_folder, role_folder


def check_output(out: str, step_folder: str, role_folder: str, overwrite: bool) -> None:
    """Refuse an output that would replace or mix with what training wrote (see the module docstring)."""
    out, step, role = (os.path.realpath(p) for p in (out, step_folder, role_folder))
    run = os.path.dirname(step)

    def inside(path: str, folder: str) -> bool:
        return path == folder or path.startswith(folder + os.sep)

    if inside(step, out):
        raise CheckpointError(f"--output {out} is the checkpoint {step} or a folder holding it; choose another")
    if inside(out, run) and out != os.path.join(role, DEFAULT_OUTPUT):
        raise CheckpointError(
            f"--output {out} is inside the run folder {run}, where training writes; choose a folder outside it "
            f"(or leave --output out for the default {os.path.join(role, DEFAULT_OUTPUT)})"
        )
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise CheckpointError(f"{out} already exists (pass --overwrite to replace a previous merge output)")
    if not os.path.isdir(out) or os.path.islink(out) or not os.path.isfile(os.path.join(out, MERGE_MARKER)):
        raise CheckpointError(
            f"{out} exists and is not an easyrl merge output (no {MERGE_MARKER} in it): --overwrite replaces only "
            "a previous merge output; remove it yourself or choose another --output"
        )


def _target_dtype(config: dict, dtype: str | None) -> torch.dtype | None:
    if dtype is not None:
        return DTYPES[dtype]
    saved = config.get("dtype") or config.get("torch_dtype")
    return DTYPES[_CONFIG_DTYPES[saved]] if saved in _CONFIG_DTYPES else None


def merge_checkpoint(
    checkpoint: str,
    output: str | None = None,
    dtype: str | None = None,
    role: str = "actor",
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    verify: bool = True,
    adapter_only: bool = False,
    base_model: str | None = None,
) -> str:
    """Write the merged Hugging Face folder of `checkpoint` and return its path (see the module docstring).

    A LoRA checkpoint (adapters only, see `easyrl.lora_merge`) is merged into its base model; `adapter_only`
    writes its PEFT adapter folder instead; `base_model` replaces the base model folder its `lora.json` names."""
    step_folder, role_folder = resolve_role_folder(checkpoint, role, verify)
    out = os.path.abspath(output or os.path.join(role_folder, DEFAULT_OUTPUT))
    check_output(out, step_folder, role_folder, overwrite)
    lora = lora_merge.adapter_info(role_folder)
    pipeline = pipeline_source(role_folder, base_model, lora, read_run_config(step_folder))
    if pipeline is not None:  # a denoiser's checkpoint: the output is a diffusers pipeline folder
        if adapter_only:
            raise CheckpointError("--adapter-only: a diffusion checkpoint is merged into its pipeline folder only")
        return merge_pipeline(role_folder, out, *pipeline, lora, DTYPES[dtype] if dtype else None, max_shard_bytes)
    hf_src = os.path.join(role_folder, HF_DIR)
    config = fsio.read_json(os.path.join(hf_src, "config.json"))
    if not isinstance(config, dict):
        raise CheckpointError(f"{hf_src}/config.json does not hold a config")
    reader = ShardedReader(role_folder)
    if base_model is not None:
        if lora is None:
            raise CheckpointError(f"--base-model: {role_folder} holds every weight, not LoRA adapters (no lora.json)")
        lora["base_model"] = os.path.abspath(base_model)
    if adapter_only and lora is None:
        raise CheckpointError(f"--adapter-only: {role_folder} holds every weight, not LoRA adapters (no lora.json)")
    if adapter_only:
        assert lora is not None
        return lora_merge.write_adapter_folder(reader, lora, hf_src, out, role_folder)
    target = _target_dtype(config, dtype)
    names, tensor_of = _tensor_source(reader, lora, bool(config.get("tie_word_embeddings", False)))
    with fsio.folder_replaced_atomically(out) as tmp:
        shards: list[list[str]] = []
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = total = 0
        for name, tensor in _in_checkpoint_layout(hf_src, ((n, tensor_of(n)) for n in names)):
            if target is not None and tensor.is_floating_point():
                tensor = tensor.to(target)
            size = tensor.numel() * tensor.element_size()
            if pending and pending_bytes + size > max_shard_bytes:
                shards.append(_flush(tmp, len(shards), pending))
                pending, pending_bytes = {}, 0
            pending[name] = tensor.contiguous()
            pending_bytes += size
            total += size
        if pending or not shards:
            shards.append(_flush(tmp, len(shards), pending))
        _name_shards(tmp, shards, total)
        if target is not None:
            config["dtype"] = _HF_NAMES[target]
            config.pop("torch_dtype", None)
        fsio.write_json(os.path.join(tmp, "config.json"), config)
        for entry in sorted(os.listdir(hf_src)):
            if entry != "config.json" and os.path.isfile(os.path.join(hf_src, entry)):
                fsio.copy_file(os.path.join(hf_src, entry), os.path.join(tmp, entry))
        fsio.write_json(os.path.join(tmp, MERGE_MARKER), {"source": role_folder, "tensors": len(names)})
    logger.info(
        "merged %d tensors (%d shard files, %.1f MiB) from %s into %s",
        len(names),
        len(shards),
        total / 2**20,
        role_folder,
        out,
    )
    return out


def _in_checkpoint_layout(
    hf_src: str, tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors under the names and layouts the model's own checkpoints use: a checkpoint holds what training held
    (transformers 5 fuses MoE experts into 3D tensors when it loads), and the merge writes what the hub's checkpoint of
    the model looks like (one matrix per expert), which vLLM and other readers load without guessing a layout
    (`easyrl.models.weight_layout`). Read from the saved config.json alone; the model is built on the meta device."""
    from transformers import AutoConfig

    from easyrl.models.weight_layout import checkpoint_layout

    try:
        config = AutoConfig.from_pretrained(hf_src)
    except ValueError as exc:  # a model type this transformers does not know (remote code): written as held
        logger.info("%s: tensors written as training held them (%s)", hf_src, exc)
        return tensors
    convert = checkpoint_layout(config)
    return tensors if convert is None else convert(tensors)


def _tensor_source(
    reader: ShardedReader, lora: dict | None, tied: bool
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names, name -> full tensor) to write: the checkpoint's tensors, or a LoRA checkpoint's base + adapters."""
    if lora is not None:
        return lora_merge.merged_source(reader, lora, tied)
    names = reader.names() + ([] if tied else [a for a in reader.aliases if a not in reader.infos])

    def tensor_of(name: str) -> torch.Tensor:
        return reader.full_tensor(reader.aliases.get(name, name) if name not in reader.infos else name)

    return names, tensor_of


def _flush(folder: str, index: int, tensors: dict[str, torch.Tensor]) -> list[str]:
    fsio.save_tensors(os.path.join(folder, f"part-{index:05d}.safetensors"), tensors, {"format": "pt"})
    return list(tensors)


def _name_shards(folder: str, shards: list[list[str]], total: int) -> None:
    """Rename the parts to HF names (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index)."""
    if len(shards) == 1:
        fsio.rename(os.path.join(folder, "part-00000.safetensors"), os.path.join(folder, "model.safetensors"))
        return
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        fsio.rename(os.path.join(folder, f"part-{i:05d}.safetensors"), os.path.join(folder, final))
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fsio.write_bytes(os.path.join(folder, "model.safetensors.index.json"), json.dumps(index, indent=2).encode())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="easyrl merge", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("checkpoint", nargs="?", help="a global_step_<N> folder, or its actor/critic subfolder")
    parser.add_argument(
        "--local_dir",
        "--local-dir",
        dest="local_dir",
        default=None,
        help="EasyR1's spelling of CHECKPOINT: the role folder, e.g. <ckpt>/global_step_<N>/actor",
    )
    parser.add_argument(
        "--output", "-o", default=None, help="output folder (default: <role folder>/huggingface_merged)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: the saved config's)"
    )
    parser.add_argument("--role", default="actor", help="role subfolder merged from a global_step_<N> folder")
    parser.add_argument(
        "--max-shard-size-gb", type=_shard_size_gb, default=5.0, help="split the weights past this size"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing output folder written by an earlier merge"
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA checkpoints: write the PEFT adapter folder (adapter_config.json + adapter_model.safetensors) "
        "instead of the merged model",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="LoRA checkpoints: the base model folder (default: the one recorded in the checkpoint's lora.json)",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 check of every checkpoint file (sizes are still checked); for very large checkpoints",
    )
    return parser


def _shard_size_gb(text: str) -> float:
    """A positive, finite size: `nan` compares False with everything and `inf` overflows int(), both tracebacks."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB (e.g. 5)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive, finite number of GB (e.g. 5)")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of `easyrl merge`; returns the process exit code (0 ok, 1 a checkpoint error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint and args.local_dir and os.path.abspath(args.checkpoint) != os.path.abspath(args.local_dir):
        parser.error(f"CHECKPOINT ({args.checkpoint}) and --local_dir ({args.local_dir}) name different folders")
    checkpoint = args.checkpoint or args.local_dir
    if not checkpoint:
        parser.error("name the checkpoint: easyrl merge <ckpt>/global_step_<N> (or --local_dir <.../actor>)")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        out = merge_checkpoint(
            checkpoint,
            args.output,
            args.dtype,
            args.role,
            int(args.max_shard_size_gb * 2**30),
            args.overwrite,
            verify=not args.no_verify,
            adapter_only=args.adapter_only,
            base_model=args.base_model,
        )
    except CheckpointError as exc:
        logger.error("easyrl merge: %s", exc)
        return 1
    except OSError as exc:  # a full disk, a quota, a read-only output: the half-written folder is already removed
        logger.error(
            "easyrl merge: writing the merged model failed (%s); no output was left behind: free space or give "
            "--output on another disk",
            exc,
        )
        return 1
    # stdout, so scripts can take it: EasyR1 users look for the weights in <role>/huggingface, which is not here.
    if args.adapter_only:
        print(f"LoRA adapter: {out} (load it with peft.PeftModel.from_pretrained or vLLM's LoRARequest)")
    else:
        print(f"merged model: {out} (load it with from_pretrained; <role folder>/huggingface holds no weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
