"""Config checks against values that pass a type check but cannot be meant: non-finite numbers, a run folder named
outside the checkpoint root, a sample count no machine holds, a resume onto another world size.

Each is found here, before anything starts, as one line naming the key; otherwise it surfaces late (a NaN
temperature ~40 s later inside transformers, a world-size change only once the workers have started).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any

from easyrl.config.errors import ConfigError


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig

# The tokens of one step's samples (rollout_batch_size * n * (prompt + response)) are indexed by int32 in packed
# and flattened kernels, and the driver holds several int64/float32 tensors of that size: past 2**31 tokens a
# step cannot run on any machine, so such a `rollout.n` is a typo, not a plan.
MAX_TOKENS_PER_STEP = 2**31 - 1


def check_limits(cfg: EasyRLConfig) -> None:
    """Raise `ConfigError` for the first value that is well-typed but impossible (see the module docstring)."""
    _check_finite(dataclasses.asdict(cfg), "")
    _check_run_names(cfg)
    _check_step_size(cfg)
    _check_resume_world_size(cfg)


def _check_finite(tree: Any, prefix: str) -> None:
    """Every float in the config, free-form mappings included, is finite (YAML spells them .nan, .inf)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            _check_finite(value, f"{prefix}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ConfigError(prefix, f"is {tree}: every number in the config must be finite; give a real value")


def _check_run_names(cfg: EasyRLConfig) -> None:
    """The default run folder is `checkpoints/<project_name>/<experiment_name>`: a name holding a separator or
    `..` would put it (and what pruning deletes) outside that root."""
    for key in ("trainer.project_name", "trainer.experiment_name"):
        name = getattr(cfg.trainer, key.split(".")[1])
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ConfigError(
                key,
                f"{name!r} is not a plain name (it names the run folder under checkpoints/); drop '/', '\\' and "
                "'..', or set trainer.save_checkpoint_path to choose the folder itself",
            )


def _check_step_size(cfg: EasyRLConfig) -> None:
    n, prompts = cfg.worker.rollout.n, cfg.data.rollout_batch_size
    tokens = prompts * n * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    if tokens > MAX_TOKENS_PER_STEP:
        raise ConfigError(
            "worker.rollout.n",
            f"{n} responses for each of {prompts} prompts of up to {cfg.data.max_prompt_length} + "
            f"{cfg.data.max_response_length} tokens make {tokens:,} tokens a step, beyond the {MAX_TOKENS_PER_STEP:,} "
            "one step can index; lower worker.rollout.n or data.rollout_batch_size",
        )


def _check_resume_world_size(cfg: EasyRLConfig) -> None:
    """Sharded optimizer and RNG state resume only onto the world size that saved them: compare with the actor's
    `meta.json` now rather than after the workers have started (read as JSON: no torch import here)."""
    folder = cfg.trainer.load_checkpoint_path or (
        _newest_step(cfg.trainer.save_checkpoint_path) if cfg.trainer.find_last_checkpoint else None
    )
    if not folder:
        return
    meta_path = os.path.join(folder, "actor", "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            saved = json.load(f).get("world_size")
    except (OSError, ValueError, AttributeError):
        return  # no readable record: the checkpoint's own verification reports that, naming the file
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if isinstance(saved, int) and saved != workers:
        key = "trainer.load_checkpoint_path" if cfg.trainer.load_checkpoint_path else "trainer.n_gpus_per_node"
        raise ConfigError(
            key,
            f"checkpoint {folder} was saved by {saved} workers but this run has {workers} (n_gpus_per_node * nnodes): "
            f"resume with {saved} workers, or `easyrl merge {folder}` and start a new run from the merged model",
        )


def _newest_step(root: str | None) -> str | None:
    """The newest committed `global_step_<N>` under `root` (what `find_last_checkpoint` would resume)."""
    from easyrl.checkpoint.manager import MANIFEST, STEP_PREFIX

    if not root or not os.path.isdir(root):
        return None
    steps = []
    for entry in os.listdir(root):
        tail = entry[len(STEP_PREFIX) :]
        if entry.startswith(STEP_PREFIX) and tail.isdigit() and os.path.isfile(os.path.join(root, entry, MANIFEST)):
            steps.append(int(tail))
    return os.path.join(root, f"{STEP_PREFIX}{max(steps)}") if steps else None
