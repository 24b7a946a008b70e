"""Checkpoints: per-rank sharded safetensors on the workers, atomic commit/prune/resume on the driver, merge.

* :class:`CheckpointMixin` (worker side): `save_checkpoint(folder, save_model_only)` / `load_checkpoint(folder)`.
* :class:`CheckpointManager` (driver side): `begin` / `commit` / `latest` / `resolve_load`, pruning.
* :func:`verify_checkpoint`: every file against the SHA-256 in the manifest, and the step against the folder.
* :func:`write_trainer_state` / :func:`read_trainer_state`: the driver's own resumable state; the config each
  checkpoint was saved under is kept beside it (`RUN_CONFIG`, read with :func:`read_run_config`).
* `easyrl merge` (:mod:`easyrl.merge`): a checkpoint to a Hugging Face folder.

Nothing here unpickles: every file read is JSON or safetensors, and anything else raises :class:`CheckpointError`.
"""

from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.manager import (
    RUN_CONFIG,
    CheckpointManager,
    is_complete,
    is_resumable,
    read_run_config,
    read_trainer_state,
    verify_checkpoint,
    write_trainer_state,
)
from easyrl.checkpoint.rng import RngState
from easyrl.checkpoint.sharded import ShardedReader
from easyrl.checkpoint.worker import CheckpointMixin


__all__ = [
    "RUN_CONFIG",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMixin",
    "RngState",
    "ShardedReader",
    "is_complete",
    "is_resumable",
    "read_run_config",
    "read_trainer_state",
    "verify_checkpoint",
    "write_trainer_state",
]
