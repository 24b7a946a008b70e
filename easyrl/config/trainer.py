"""Configuration of the training run: length, resources, logging, validation, checkpoints (``trainer.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many steps (overrides `total_epochs` when smaller)."""
    project_name: str = "easyrl"
    """Project name (trackers, checkpoint folder)."""
    experiment_name: str = "demo"
    """Experiment name (trackers, checkpoint folder)."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Where metrics go: console, file, tensorboard, wandb, swanlab, mlflow."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    n_gpus_per_node: int = 8
    """Workers per node: one per GPU (on a machine without GPUs, CPU workers)."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cuda or cpu."""
    seed: int = 1
    """Seed of model init, dropout and sampling helpers."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts updating."""
    max_staleness: int = 0
    """Asynchronous rollouts with carry-over (colocated): a trained token may come from a policy up to this many
    updates older than the one it trains. 0 is the synchronous loop. With S >= 1 more prompt groups are in flight
    than a step trains on (`worker.rollout.active_groups`), each step trains on the groups that finish first, and
    unfinished responses carry over to the next step, resumed with the new weights (docs/async.md). At most 64, and
    the groups in flight must fit 2^32 tokens (checked at load)."""
    val_freq: int = -1
    """Validate every N steps; -1: never (except before training/at the end when asked)."""
    val_before_train: bool = True
    """Validate once before the first step (a resumed run does not: it continues the history it resumes)."""
    val_only: bool = False
    """Only validate, then exit."""
    val_generations_to_log: int = 0
    """Validation generations (prompt, response, ground truth, score) sent to the loggers."""
    save_freq: int = -1
    """Save a checkpoint every N steps; -1: only at the end."""
    save_limit: int = -1
    """Keep the newest N checkpoints (plus the best by validation score); -1: keep all."""
    save_model_only: bool = False
    """Save only the model weights (no optimizer, no trainer state): cannot resume."""
    save_checkpoint_path: str | None = None
    """Checkpoint and log folder; default `checkpoints/<project_name>/<experiment_name>`."""
    load_checkpoint_path: str | None = None
    """Resume from this checkpoint folder (an error if it does not exist or is incomplete)."""
    find_last_checkpoint: bool = True
    """Resume from the newest complete checkpoint under `save_checkpoint_path` when there is one."""
    verify_checkpoint: bool = True
    """Check every file of the checkpoint resumed from against the SHA-256 in its manifest (about 1 s per GB);
    false checks sizes and steps only, for very large checkpoints (said in the log)."""
    fallback_to_older_checkpoint: bool = False
    """When the newest checkpoint is corrupt, resume from the newest intact older one (logged with both names)
    instead of stopping with an error."""
    allow_model_change_on_resume: bool = False
    """Resume even when the model (`model_path`, `tokenizer_path`, `override_config`, the LoRA shape) differs from
    the config saved with the checkpoint; without it such a resume is refused naming the changed keys. Other
    changes are allowed and named in the log."""
    save_on_interrupt: bool = False
    """On SIGTERM/SIGINT/SIGHUP, save a checkpoint before exiting."""
    worker_timeout_s: float = 3600.0
    """Longest a single worker call may take before the run stops naming the role."""
    hang_timeout_s: float = 120.0
    """A worker that stops answering (no heartbeat: stopped by SIGSTOP, or stuck on a device or file system) while
    the driver waits ends the run within this many seconds, with one line naming the call, role and rank, after every
    rank's Python stack is written to `<save_checkpoint_path>/hang_stacks/` (docs/reliability.md)."""
    stop_grace_s: float = 30.0
    """On SIGTERM/SIGINT/SIGHUP, how long a worker call in flight may take to end: the run then stops at that stage
    boundary (saving with `save_on_interrupt`); a call still running after it is given up and the run stops without
    saving, since the workers are still inside it."""
    ray_num_cpus: int | None = None
    """CPUs given to a local Ray cluster; default: all."""
    backend: str = "auto"
    """Where the workers run: `auto` (inline exactly when every role is one rank on this node and nothing needs a
    process of its own, else Ray; the plan says which and why), `ray` (a Ray worker process per role and rank) or
    `inline` (each role's worker in the driver's own process: no Ray, a `breakpoint()` in a loss stops in the
    terminal). The same results either way (docs/distributed.md, "One process")."""
