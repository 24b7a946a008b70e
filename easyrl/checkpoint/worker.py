"""The worker side: `CheckpointMixin` gives the actor and critic workers `save_checkpoint` / `load_checkpoint`.

Each rank writes and reads only its own files (see :mod:`easyrl.checkpoint.sharded` for the layout); rank 0 also
writes the Hugging Face side files (config, generation config, tokenizer) into ``<folder>/huggingface``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from easyrl.checkpoint import fsio, sharded
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.rng import RngState, rng_paths
from easyrl.distributed import Dispatch, register


logger = logging.getLogger(__name__)

HF_DIR = "huggingface"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""Files copied from the tokenizer (or processor) folder into `huggingface/`, when present."""
LORA_FILE = "lora.json"
"""In a LoRA policy's role folder: rank, alpha, adapted modules and the base model folder (`easyrl merge` reads it)."""
MERGE_MARKER = "easyrl_merged.json"
"""Written last into an `easyrl merge` output folder: `--overwrite` replaces only folders that carry it."""


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size (the default process group, else RANK / WORLD_SIZE)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def write_hf_files(folder: str, model: nn.Module, model_path: str | None, tokenizer_path: str | None) -> None:
    """Write `config.json` (with the real architecture), `generation_config.json` and tokenizer files to `folder`."""
    fsio.makedirs(folder)
    config = getattr(model, "config", None)
    if config is not None and not hasattr(config, "to_json_string"):  # a diffusers model: a FrozenDict config
        doc = {"_class_name": sharded.model_class_name(model), **json.loads(json.dumps(dict(config), default=str))}
        fsio.write_json(os.path.join(folder, "config.json"), doc)
    elif config is not None:
        doc = json.loads(config.to_json_string(use_diff=False))
        doc["architectures"] = [sharded.model_class_name(model)]
        doc.pop("use_cache", None)  # the training copy disables the KV cache; generation wants the default
        fsio.write_json(os.path.join(folder, "config.json"), doc)
    gen_src = os.path.join(model_path, "generation_config.json") if model_path else ""
    if gen_src and os.path.isfile(gen_src):
        fsio.copy_file(gen_src, os.path.join(folder, "generation_config.json"))
    elif getattr(model, "generation_config", None) is not None:
        text = model.generation_config.to_json_string()  # type: ignore[union-attr,operator]
        fsio.write_bytes(os.path.join(folder, "generation_config.json"), text.encode("utf-8"))
    source = tokenizer_path or model_path
    copied = []
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            src = os.path.join(source, name)
            if os.path.isfile(src):
                fsio.copy_file(src, os.path.join(folder, name))
                copied.append(name)
    if not copied and source:  # no source at all: a role without a tokenizer (a diffusion pipeline's denoiser)
        logger.warning("no tokenizer files found in %s; %s has no tokenizer", source, folder)
    fsio.fsync_dir(folder)


def save_worker_state(
    folder: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    rank: int,
    world: int,
    trainable_only: bool = False,
) -> None:
    """Write this rank's files: model shards (`trainable_only`: the adapters of a LoRA policy); with an optimizer,
    also optimizer, scheduler (rank 0) and RNG."""
    fsio.makedirs(folder)
    sharded.save_model(folder, model, rank, world, trainable_only)
    if optimizer is not None:
        sharded.save_optimizer(folder, model, optimizer, rank, world)
        if scheduler is not None and rank == 0:
            fsio.write_json(os.path.join(folder, "scheduler.json"), scheduler.state_dict())
        RngState.capture().save(*rng_paths(folder, f"rng_rank{rank}"))


def load_worker_state(
    folder: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    rank: int,
    world: int,
    trainable_only: bool = False,
) -> None:
    """Inverse of :func:`save_worker_state` for the same world size. Only safetensors and JSON are read.

    A model-only checkpoint (no optimizer files) restores the weights and leaves the optimizer, scheduler and
    RNG as they are.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    sharded.load_model(folder, model, rank, world, trainable_only)
    has_optim = os.path.exists(sharded.optim_file(folder, rank, world))
    if optimizer is None or not has_optim:
        if optimizer is not None:
            logger.warning("%s has no optimizer state (saved with save_model_only): weights restored only", folder)
        return
    sharded.load_optimizer(folder, model, optimizer, rank, world)
    if scheduler is not None:
        state = fsio.read_json(os.path.join(folder, "scheduler.json"))
        if not isinstance(state, dict):
            raise CheckpointError(f"{folder}/scheduler.json does not hold a state dict")
        try:
            scheduler.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"cannot load {folder}/scheduler.json: {exc}") from exc
    RngState.load(*rng_paths(folder, f"rng_rank{rank}")).restore()


class CheckpointMixin:
    """Adds `save_checkpoint` / `load_checkpoint` (dispatched to every rank) to a training worker.

    The worker must have `model` (FSDP2-sharded or plain), `optimizer` and `scheduler`. The Hugging Face side
    files come from the worker's `cfg.worker.<role>.model` (role: `role_name`, else `EASYRL_ROLE`, else
    `actor`); override :meth:`checkpoint_sources` to change that. :meth:`after_load_checkpoint` runs after a
    load (the actor marks its co-located rollout engine stale there, so it takes the restored weights).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any

    def checkpoint_sources(self) -> tuple[str | None, str | None]:
        """(model folder, tokenizer folder) whose config/tokenizer files go into `huggingface/`."""
        cfg = getattr(self, "cfg", None)
        worker_cfg = getattr(cfg, "worker", None)
        if worker_cfg is None:
            return None, None
        role = self._role()
        mcfg = getattr(getattr(worker_cfg, role, None), "model", None)
        actor_cfg = worker_cfg.actor.model
        model_path = getattr(mcfg, "model_path", None) or actor_cfg.model_path
        tokenizer_path = getattr(mcfg, "tokenizer_path", None) or actor_cfg.tokenizer_path or model_path
        return model_path, tokenizer_path

    def _role(self) -> str:
        return getattr(self, "role_name", None) or os.environ.get("EASYRL_ROLE") or "actor"

    def adapter_checkpoint(self) -> dict[str, Any] | None:
        """A LoRA role's adapter description (written as `lora.json`): its checkpoints hold only the trainable
        weights (the adapters, and a critic's value head); None (default): every weight is saved."""
        return None

    def after_load_checkpoint(self) -> None:
        """Hook run on every rank after a successful `load_checkpoint` (default: nothing)."""

    @register(dispatch=Dispatch.ALL)
    def save_checkpoint(self, folder: str, save_model_only: bool = False) -> None:
        """Write this rank's shards (and, on rank 0, the HF side files) into `folder`.

        No collective runs here, so a failure on one rank surfaces on the driver instead of hanging the others.
        """
        rank, world = rank_and_world()
        optimizer = None if save_model_only else self.optimizer
        scheduler = None if save_model_only else getattr(self, "scheduler", None)
        lora = self.adapter_checkpoint()
        save_worker_state(folder, self.model, optimizer, scheduler, rank, world, trainable_only=lora is not None)
        if rank == 0:
            write_hf_files(os.path.join(folder, HF_DIR), self.model, *self.checkpoint_sources())
            if lora is not None:
                fsio.write_json(os.path.join(folder, LORA_FILE), lora)
        fsio.fsync_dir(folder)
        logger.info("rank %d saved its checkpoint shards to %s", rank, folder)

    @register(dispatch=Dispatch.ALL)
    def load_checkpoint(self, folder: str) -> None:
        """Restore model, optimizer, scheduler and RNG from `folder` (saved by the same number of ranks)."""
        rank, world = rank_and_world()
        adapters_only = self.adapter_checkpoint() is not None
        if adapters_only != os.path.isfile(os.path.join(folder, LORA_FILE)):
            raise CheckpointError(
                f"{folder} was saved {'without' if adapters_only else 'with'} LoRA adapters, and this run "
                f"{'trains them' if adapters_only else 'has none'}: resume with the same "
                f"worker.{self._role()}.model.lora"
            )
        scheduler = getattr(self, "scheduler", None)
        load_worker_state(folder, self.model, self.optimizer, scheduler, rank, world, adapters_only)
        self.after_load_checkpoint()
        logger.info("rank %d loaded its checkpoint shards from %s", rank, folder)
