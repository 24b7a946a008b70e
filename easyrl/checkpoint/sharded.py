"""Per-rank sharded checkpoints of an FSDP2 model, its optimizer, LR scheduler and RNG, with safetensors + JSON.

Layout of one role's folder (e.g. ``global_step_10/actor``) written by ``W`` ranks::

    meta.json                          rank 0: format, world size, model class, tied-parameter aliases
    model_rank{r}_of{W}.safetensors    each rank: its local shard of every parameter (and persistent buffer)
    optim_rank{r}_of{W}.safetensors    each rank: its local shard of every optimizer state tensor (exp_avg, step...)
    optim_rank{r}.json                 each rank: param groups (lr, betas...) and non-tensor optimizer state
    scheduler.json                     rank 0: the LR scheduler's state_dict
    rng_rank{r}.safetensors/.json      each rank: torch generator states / Python and NumPy states
    huggingface/                       rank 0: config.json, generation_config.json, tokenizer files

The safetensors header of every shard file records, for each tensor, its global shape, the dimension it is
sharded on (``null``: replicated) and this rank's offset along that dimension, so the full tensors can be
reassembled from any number of rank files (see :class:`ShardedReader`). Optimizer, scheduler and RNG files only
exist when the checkpoint was not saved with ``save_model_only``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError


logger = logging.getLogger(__name__)

FORMAT = "easyrl-sharded-v1"
"""Format tag written into every shard header and `meta.json`."""
HEADER_KEY = "easyrl"
SEP = "::"
"""Separates a parameter name from an optimizer state key in the optimizer shard files."""
_MODEL_RE = re.compile(r"^model_rank(\d+)_of(\d+)\.safetensors$")


def model_file(folder: str, rank: int, world: int) -> str:
    return os.path.join(folder, f"model_rank{rank}_of{world}.safetensors")


def optim_file(folder: str, rank: int, world: int) -> str:
    return os.path.join(folder, f"optim_rank{rank}_of{world}.safetensors")


def optim_json(folder: str, rank: int) -> str:
    return os.path.join(folder, f"optim_rank{rank}.json")


# --------------------------------------------------------------------------------------------- shard geometry
def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of `t` (a view sharing storage), or `t` itself for a plain tensor."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def shard_info(t: torch.Tensor) -> dict[str, Any]:
    """Global shape, shard dimension (None: replicated) and this rank's offset along it for `t`.

    Supports plain tensors (replicated) and DTensors on a one-dimensional mesh with a `Shard(d)` (chunked like
    `torch.chunk`, as FSDP2 does) or `Replicate` placement.
    """
    local = local_tensor(t)
    info: dict[str, Any] = {"global_shape": list(t.shape), "shard_dim": None, "offset": 0, "dtype": str(local.dtype)}
    info["dtensor"] = _is_dtensor(t)
    if not info["dtensor"]:
        return info
    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = t.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1:
        raise CheckpointError(f"cannot checkpoint a DTensor on a {mesh.ndim}-D mesh (only 1-D meshes are supported)")
    placement = placements[0]
    if placement.is_replicate():
        return info
    if not placement.is_shard():
        raise CheckpointError(f"cannot checkpoint a DTensor with placement {placement} (Shard or Replicate only)")
    dim = int(placement.dim)
    size, world, coord = t.shape[dim], mesh.size(), mesh.get_local_rank()
    # torch.chunk's split, as FSDP2 shards: ceil(size / world) rows per rank, the last ranks short or empty (an empty
    # shard's offset is clamped to `size`).
    chunk = -(-size // world)
    offset = min(coord * chunk, size)
    expected = max(0, min(chunk, size - offset))
    if local.shape[dim] != expected:
        raise CheckpointError(
            f"unexpected shard geometry: local size {local.shape[dim]} along dim {dim}, expected {expected} "
            f"(global {size}, rank {coord} of {world})"
        )
    info.update(shard_dim=dim, offset=offset)
    return info


def _same_geometry(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    keys = ("global_shape", "shard_dim", "offset")
    return all(saved.get(k) == current.get(k) for k in keys)


# --------------------------------------------------------------------------------------------- model
def model_tensors(model: nn.Module, trainable_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> parameter or persistent buffer, deduplicated; alias name -> canonical name of tied parameters).

    `trainable_only`: the parameters that require gradients and nothing else (a LoRA policy's adapters: its
    frozen base is reloaded from the model folder)."""
    if trainable_only:
        # Adapters are never tied: no aliases.
        return {name: p for name, p in model.named_parameters() if p.requires_grad}, {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    # Every name of a tied parameter: the first is stored, the others are recorded as its aliases.
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases[name] = seen[id(param)]
            continue
        seen[id(param)] = name
        tensors[name] = param
    for mod_name, module in model.named_modules():
        for buf_name, buf in module._buffers.items():
            # Persistent buffers only, as state_dict keeps them (rotary frequencies are computed at model build).
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            name = f"{mod_name}.{buf_name}" if mod_name else buf_name
            tensors.setdefault(name, buf)
    return tensors, aliases


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (not the FSDP2 wrapper class `fully_shard` swaps in)."""
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swaps in a class `FSDP<Name>(FSDPModule, Name)`: the first class of the MRO outside FSDPModule is the
    # model's own.
    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(model).__name__


def save_model(folder: str, model: nn.Module, rank: int, world: int, trainable_only: bool = False) -> None:
    """Write this rank's local shards of `model` (and rank 0's `meta.json`) into `folder`; `trainable_only`: the
    trainable parameters alone (see `model_tensors`), which `meta.json` records."""
    tensors, aliases = model_tensors(model, trainable_only)
    infos = {name: shard_info(t) for name, t in tensors.items()}
    header = {"rank": rank, "world_size": world, "tensors": infos, "aliases": aliases}
    locals_ = {name: local_tensor(t) for name, t in tensors.items()}
    fsio.save_tensors(model_file(folder, rank, world), locals_, {"format": FORMAT, HEADER_KEY: json.dumps(header)})
    if rank == 0:
        config = getattr(model, "config", None)
        meta = {
            "format": FORMAT,
            "world_size": world,
            "model_class": model_class_name(model),
            "aliases": aliases,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "trainable_only": trainable_only,
        }
        fsio.write_json(os.path.join(folder, "meta.json"), meta)


def checkpoint_world_size(folder: str) -> int:
    """The world size a role folder was saved with (from `meta.json`, else from the shard file names)."""
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        meta = fsio.read_json(meta_path)
        if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
            raise CheckpointError(f"{meta_path} has no integer world_size")
        return int(meta["world_size"])
    worlds = (
        {int(m.group(2)) for f in os.listdir(folder) if (m := _MODEL_RE.match(f))} if os.path.isdir(folder) else set()
    )
    if len(worlds) != 1:
        raise CheckpointError(f"{folder} holds no (or inconsistent) model_rank*_of*.safetensors files")
    return worlds.pop()


def _check_world(folder: str, world: int) -> None:
    saved = checkpoint_world_size(folder)
    if saved != world:
        raise CheckpointError(
            f"checkpoint {folder} was saved by {saved} workers but this run has {world}: optimizer and RNG state "
            f"can only be resumed with the same world size. Resume with {saved} workers, or merge the weights "
            f"(`easyrl merge {folder}`) and start a new run from the merged model."
        )


def load_model(folder: str, model: nn.Module, rank: int, world: int, trainable_only: bool = False) -> None:
    """Copy this rank's saved shards into `model`'s parameters and buffers in place (same world size only);
    `trainable_only`: the checkpoint holds the trainable parameters alone (a LoRA policy's adapters)."""
    _check_world(folder, world)
    path = model_file(folder, rank, world)
    saved, meta = fsio.read_tensors(path)
    header = fsio.json_metadata(meta, HEADER_KEY, path)
    tensors, _ = model_tensors(model, trainable_only)
    saved_infos = header.get("tensors", {}) if isinstance(header, dict) else {}
    missing = sorted(set(tensors) - set(saved))
    extra = sorted(set(saved) - set(tensors))
    if missing or extra:
        raise CheckpointError(f"{path} does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, t in tensors.items():
            current = shard_info(t)
            if not _same_geometry(saved_infos.get(name, {}), current):
                raise CheckpointError(f"{path}: {name} was saved as {saved_infos.get(name)}, the model has {current}")
            local = local_tensor(t)
            if saved[name].shape != local.shape:
                raise CheckpointError(
                    f"{path}: {name} has local shape {tuple(saved[name].shape)}, expected {tuple(local.shape)}"
                )
            local.copy_(saved[name])  # in place: `local` shares the DTensor's storage


# --------------------------------------------------------------------------------------------- optimizer
def save_optimizer(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Write this rank's optimizer state: tensors (local shards) as safetensors, param groups and scalars as JSON."""
    names = {id(p): n for n, p in model.named_parameters()}  # deduplicated, as `model_tensors` names them
    tensors: dict[str, torch.Tensor] = {}
    infos: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointError("the optimizer holds a parameter that is not a parameter of the model")
            name = names[id(param)]
            group_names.append(name)
            # a parameter that never stepped has no state yet
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{name}{SEP}{key}"] = local_tensor(value)
                    infos[f"{name}{SEP}{key}"] = shard_info(value)
                else:
                    scalars.setdefault(name, {})[key] = value
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "param_names": group_names})
    header = {"rank": rank, "world_size": world, "tensors": infos}
    fsio.save_tensors(optim_file(folder, rank, world), tensors, {"format": FORMAT, HEADER_KEY: json.dumps(header)})
    fsio.write_json(optim_json(folder, rank), {"format": FORMAT, "param_groups": groups, "scalars": scalars})


def _restore_types(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples (e.g. `betas`) into lists: give them back the current group's types."""
    out = dict(saved)
    for key, value in current.items():
        if key in out and isinstance(value, tuple) and isinstance(out[key], list):
            out[key] = tuple(out[key])
    return out


def load_optimizer(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Load this rank's optimizer state saved by `save_optimizer` (same world size and parameter order)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _check_world(folder, world)
    path = optim_file(folder, rank, world)
    saved, meta = fsio.read_tensors(path)
    header = fsio.json_metadata(meta, HEADER_KEY, path)
    jpath = optim_json(folder, rank)
    doc = fsio.read_json(jpath)
    if not isinstance(doc, dict) or not isinstance(doc.get("param_groups"), list):
        raise CheckpointError(f"{jpath} has no param_groups")
    if len(doc["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{jpath}: {len(doc['param_groups'])} param groups saved, the optimizer has {len(optimizer.param_groups)}"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    infos = header.get("tensors", {}) if isinstance(header, dict) else {}
    scalars = doc.get("scalars", {})
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0  # load_state_dict pairs state with parameters by position across the groups
    for group, saved_group in zip(optimizer.param_groups, doc["param_groups"]):
        current_names = [names[id(p)] for p in group["params"]]
        if saved_group.get("param_names") != current_names:
            raise CheckpointError(f"{jpath}: the saved parameter order does not match the optimizer's")
        ids = []
        for param, name in zip(group["params"], current_names):
            entry: dict[str, Any] = dict(scalars.get(name, {}))
            prefix = f"{name}{SEP}"
            for key in [k for k in saved if k.startswith(prefix)]:
                value, info = saved[key], infos.get(key, {})
                # Rebuild the DTensor from this rank's shard: `shape` and `stride` are given because from_local would
                # otherwise assume an even split (run_check=False: no cross-rank check, a collective).
                if info.get("dtensor") and _is_dtensor(param):
                    placement = Replicate() if info.get("shard_dim") is None else Shard(int(info["shard_dim"]))
                    shape = torch.Size(info["global_shape"])
                    if shape != param.shape:
                        raise CheckpointError(
                            f"{path}: {key} has global shape {list(shape)}, the parameter {list(param.shape)}"
                        )
                    value = DTensor.from_local(
                        value.to(local_tensor(param).device),
                        param.device_mesh,
                        [placement],  # type: ignore[attr-defined]
                        run_check=False,
                        shape=shape,
                        stride=param.stride(),
                    )
                    if not _same_geometry(info, shard_info(value)):
                        raise CheckpointError(f"{path}: {key} geometry {info} does not match this run")
                entry[key[len(prefix) :]] = value
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        # The saved hyperparameters (lr, betas...) win; `params` are the positions load_state_dict expects.
        groups.append({**_restore_types(saved_group.get("hyper", {}), group), "params": ids})
    try:
        # casts state tensors to each parameter's dtype, `step` excepted
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load optimizer state from {path}: {exc}") from exc


# --------------------------------------------------------------------------------------------- reading any world size
def _offset(info: dict[str, Any]) -> int:
    """A piece's recorded offset, -1 when it is not an integer (sorted first, then refused as not tiling)."""
    offset = info.get("offset")
    return offset if type(offset) is int else -1


class ShardedReader:
    """Reassembles full tensors from all the `model_rank*_of*.safetensors` files of a role folder.

    Works for any world size: each piece is placed by the global shape, shard dimension and offset recorded in
    its file's header. Files are opened with `safetensors.safe_open` (memory-mapped, never unpickled).
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        world = checkpoint_world_size(folder)
        self.files = [model_file(folder, r, world) for r in range(world)]
        missing = [f for f in self.files if not os.path.exists(f)]
        stray = sorted(set(glob.glob(os.path.join(folder, "model_rank*_of*.safetensors"))) - set(self.files))
        if missing or stray:
            raise CheckpointError(
                f"{folder}: expected {world} model shard files; missing {missing}, unexpected {stray}"
            )
        self.infos: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.aliases: dict[str, str] = {}
        for r, path in enumerate(self.files):
            header = fsio.json_metadata(fsio.read_tensor_metadata(path), HEADER_KEY, path)
            tensors = header.get("tensors") if isinstance(header, dict) else None
            if not isinstance(tensors, dict) or not all(isinstance(i, dict) for i in tensors.values()):
                raise CheckpointError(f"{path}: its {HEADER_KEY!r} header entry does not list tensors")
            if header.get("world_size") != world or header.get("rank") != r:
                raise CheckpointError(f"{path} says rank {header.get('rank')} of {header.get('world_size')}")
            for name, info in header["tensors"].items():
                self.infos.setdefault(name, []).append((r, info))
            self.aliases.update(header.get("aliases", {}))
        for name, pieces in self.infos.items():
            if len(pieces) != world:
                raise CheckpointError(f"{folder}: tensor {name} is present in {len(pieces)} of {world} shard files")

    def names(self) -> list[str]:
        return list(self.infos)

    def full_tensor(self, name: str) -> torch.Tensor:
        """The full tensor `name`, reassembled from every rank's piece (checked to cover it exactly once).

        The header's claims are checked against the pieces' own shapes before anything is allocated: a header that
        claims a tensor larger than its pieces (a corrupt or forged file) must be a CheckpointError, not an attempt
        to allocate terabytes."""
        pieces = self.infos[name]
        first = pieces[0][1]
        shape = first.get("global_shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{self.files[pieces[0][0]]}: {name} has global shape {str(shape)[:80]}, not sizes")
        if first.get("shard_dim") is None:  # replicated: any rank's copy is the whole tensor
            piece = self._piece(pieces[0][0], name)
            if list(piece.shape) != shape:
                raise CheckpointError(
                    f"{self.files[pieces[0][0]]}: {name} is {list(piece.shape)}, its header claims {shape}"
                )
            return piece
        dim = first["shard_dim"]
        if type(dim) is not int or not 0 <= dim < len(shape):
            raise CheckpointError(
                f"{self.folder}: {name} has shard dimension {dim!r} for a shape of {len(shape)} dims"
            )
        pieces = sorted(pieces, key=lambda p: _offset(p[1]))
        covered = 0
        # In offset order each piece must start where the last one ended (empty shards, at offset = size, come last),
        # and have the claimed shape but along the shard dimension.
        for r, info in pieces:
            if info.get("offset") != covered or info.get("shard_dim") != dim or info.get("global_shape") != shape:
                raise CheckpointError(
                    f"{self.folder}: the shards of {name} do not tile it (rank {r}: {str(info)[:200]})"
                )
            size = self._piece_shape(r, name)
            if len(size) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(size, shape)) if i != dim):
                raise CheckpointError(f"{self.files[r]}: the piece of {name} is {size}, its header claims {shape}")
            covered += size[dim]
        if covered != shape[dim]:
            raise CheckpointError(f"{self.folder}: the shards of {name} cover {covered} of {shape[dim]}")
        out: torch.Tensor | None = None
        covered = 0
        for r, _ in pieces:
            piece = self._piece(r, name)
            if out is None:  # allocated once the saved dtype is known, and only as large as the pieces proved
                out = torch.empty(shape, dtype=piece.dtype)
            out.narrow(dim, covered, piece.shape[dim]).copy_(piece)
            covered += piece.shape[dim]
        assert out is not None
        return out

    def _piece_shape(self, rank: int, name: str) -> list[int]:
        """The shape rank `rank`'s file records for `name` (its safetensors header; no data read)."""
        from safetensors import safe_open

        try:
            with safe_open(self.files[rank], framework="pt") as handle:
                return list(handle.get_slice(name).get_shape())
        except Exception as exc:
            raise CheckpointError(f"{self.files[rank]} is not a valid safetensors file ({exc})") from exc

    def _piece(self, rank: int, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            with safe_open(self.files[rank], framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{self.files[rank]} is not a valid safetensors file ({exc})") from exc

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.infos:
            yield name, self.full_tensor(name)
