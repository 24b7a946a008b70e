"""What each worker is given: one frozen spec per role, built on the driver from the validated config.

A worker sees its own spec and nothing else: no other role's section, no batch arithmetic to redo (the per-rank
sizes are computed once, on the driver, by `easyrl.trainer.role_specs`). Pure data: no model, no engine, not the whole
config. The rollout engine's spec is the rollout room's own (`easyrl.rollout.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from easyrl.config.worker import FSDPConfig, ModelConfig, OffloadConfig, OptimConfig
from easyrl.distributed.memory import MemoryLevers
from easyrl.rollout.spec import RolloutSpec


@dataclass(frozen=True)
class ForwardOptions:
    """How the workers run their forward passes; the defaults are the plain padded path."""

    padding_free: bool = False
    """Pack the valid tokens of a micro-batch into one row."""
    fused: bool = False
    """Compute log-probs and entropy from hidden states chunk by chunk (no full logits)."""
    chunk_size: int = 1024
    """Tokens per chunk of the fused head."""
    head_kernel: str = "torch"
    """The fused head's row-wise work: torch or triton (`worker.actor.fused_head_kernel`)."""
    max_token_len: int | None = None
    """Token budget of a micro-batch (dynamic batching); None: fixed-count micro-batches. With sequence parallelism
    it is the group's (the per-rank budget times `sp_size`): each rank holds 1/`sp_size` of the tokens."""
    ulysses_size: int = 1
    """Ranks that split each packed row between them (Ulysses sequence parallelism); 1: no split."""
    ring_size: int = 1
    """Ring attention composed with Ulysses: the row is split over ulysses_size x ring_size ranks."""
    log_prob_max_token_len: int | None = None
    """Token budget of a forward-only micro-batch (old, reference and teacher log-probs), counted like
    `max_token_len`; None: `max_token_len` (`easyrl.update_levers` derives a larger one from the memory plan)."""

    @property
    def sp_size(self) -> int:
        """Ranks of one sequence-parallel group: ulysses_size x ring_size."""
        return self.ulysses_size * self.ring_size

    @property
    def forward_only_token_len(self) -> int | None:
        """The budget of the forward-only passes: `log_prob_max_token_len` with dynamic batching, else None."""
        if self.max_token_len is None:
            return None
        return self.log_prob_max_token_len or self.max_token_len

    @property
    def plain(self) -> bool:
        """The original path: padded micro-batches, full logits."""
        return not (self.padding_free or self.fused or self.max_token_len is not None or self.sp_size > 1)


@dataclass(frozen=True)
class ProcessSpec:
    """Per-process setup shared by every role."""

    seed: int
    """`trainer.seed`: Python, NumPy and torch generators of the worker."""
    user_modules: tuple[str, ...] = ()
    """`algorithm.user_modules`: imported in the worker so their registrations exist there too."""
    cpu_threads: int = 1
    """torch's intra-op threads in a CPU worker (`easyrl.trainer.role_specs.cpu_threads`); a GPU worker keeps
    torch's default."""


@dataclass(frozen=True)
class EmbedsSpec:
    """How a vision-language model reuses its vision tower's outputs (`easyrl.models.vl_embeds`): the on-disk cache
    (`data.cache_dir`, `data.cache_max_gb`) and the processor settings that key its entries."""

    cache_dir: str | None = None
    """None: no disk cache (the in-process reuse still applies)."""
    max_gb: float = 50.0
    settings: tuple[tuple[str, float], ...] = ()
    """(name, value) of the data settings that shape the patches (fps, frames, pixels)."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything `TrainableModel` needs to build one role's model."""

    model: ModelConfig
    """Where the weights are, config overrides, gradient checkpointing, vision tower."""
    kind: str = "causal_lm"
    """`causal_lm` (policy, reference) or `value` (critic: a one-output token head)."""
    torch_dtype: str | None = None
    """Load dtype (`bf16`/`fp16`/`fp32`); None: fp32."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    optim: OptimConfig | None = None
    """None: a frozen model (no gradients, no optimizer)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    forward: ForwardOptions = field(default_factory=ForwardOptions)
    total_optimizer_steps: int = 1
    """Length of the LR schedule."""
    checkpoint_files: tuple[str | None, str | None] = (None, None)
    """(model folder, tokenizer folder) whose config / tokenizer files a checkpoint carries."""
    embeds: EmbedsSpec = field(default_factory=EmbedsSpec)
    """Vision-language models: reuse and on-disk cache of the vision tower's outputs."""

    @property
    def trainable(self) -> bool:
        return self.optim is not None


@dataclass(frozen=True)
class UpdateSpec:
    """How a trained role turns a batch into optimizer steps (sizes per rank, already divided on the driver)."""

    mini_batch_size: int
    """Samples per optimizer step on this rank: global_batch_size * rollout.n / data-parallel size (world size /
    ulysses_size x ring_size: the ranks of a sequence-parallel group hold the same samples)."""
    micro_batch_size: int
    """Samples per forward/backward pass (a fixed count; dynamic batching uses the token budget instead)."""
    epochs: int
    max_grad_norm: float
    loss_avg_mode: str
    defer_gradient_sync: bool = False
    """Reduce the gradients once per mini-batch, on its last micro-batch (`worker.actor.defer_gradient_sync`,
    resolved): FSDP2's `set_requires_gradient_sync(False)` on the others. Only a multi-rank FSDP2 model is affected."""


@dataclass(frozen=True)
class PolicyLossSpec:
    """The actor's loss: the registered policy-gradient loss with its own knobs, and the KL term when it is a loss."""

    loss_type: str
    """`worker.actor.loss_type`: the registered loss."""
    params: tuple[tuple[str, Any], ...]
    """The loss's knobs as (field, value) pairs of the params class it registered, read from `worker.actor` on the
    driver (`easyrl.algorithms.policy_loss_params`); () for a loss registered without one. The worker rebuilds the
    class by the loss's name: an instance of a user's class could not be unpickled before its module is imported."""
    kl_in_loss: bool
    """Add `kl_coef * KL(policy || reference)` to the loss (`algorithm.use_kl_loss`, KL enabled)."""
    kl_penalty: str
    kl_coef: float
    distill_topk_coef: float = 0.0
    """`algorithm.distill.mode: topk_fkl`: add `coef` times the forward KL over the teacher's top-k tokens
    (`easyrl.algorithms.topk_forward_kl`) to the loss; 0: no such term."""
    measures_engine: bool = False
    """No old-log-prob pass runs before the update (skipped, run inside the update, or bypass mode): the update's
    first forward, which runs the weights that sampled, measures the engine's log-probs against its own
    (`rollout/token_prob_error`, `rollout/logprob_diff_*`; with the pass inside the update, its rows too), as the
    driver does against the pass otherwise."""


@dataclass(frozen=True)
class ActorSpec:
    process: ProcessSpec
    model: ModelSpec
    update: UpdateSpec
    loss: PolicyLossSpec
    rollout: RolloutSpec
    temperature: float
    """Log-probs are of logits / temperature, as the engine sampled them."""
    micro_batch_size_for_experience: int
    """Samples per forward pass when computing log-probs."""
    memory_levers: MemoryLevers
    """What the actor's engine names when it cannot wake for lack of GPU memory."""
    serves_reference: bool = False
    """LoRA with KL on: the actor computes the reference log-probs (its base, adapters off); no ref worker."""
    colocated_engine: bool = True
    """The rollout engine lives in this process (the HybridEngine); False with `worker.rollout.placement: separate`,
    where rollout workers of their own generate and the actor only trains."""
    old_from_first_forward: bool = False
    """An update given no `old_log_probs` runs the old-log-prob pass itself over the rows after its first mini-batch,
    and takes the first mini-batch's from its own first forward (`OldPass.AFTER_FIRST_MINI_BATCH`)."""


@dataclass(frozen=True)
class RefSpec:
    process: ProcessSpec
    model: ModelSpec
    temperature: float
    micro_batch_size_for_experience: int


@dataclass(frozen=True)
class TeacherSpec:
    """The distillation teacher (`algorithm.distill.teacher`): a frozen model run like the reference, on the
    student's token ids."""

    process: ProcessSpec
    model: ModelSpec
    """The teacher's checkpoint, with the reference's sharding and offload and the actor's forward settings."""
    temperature: float
    """Log-probs of logits / temperature: the same scaling as the student's, so the two distributions compare."""
    micro_batch_size_for_experience: int
    top_k: int = 0
    """`algorithm.distill.mode: topk_fkl`: also return the k most likely tokens at each position (ids and
    log-probs); 0: the sampled tokens' log-probs only."""


@dataclass(frozen=True)
class CriticSpec:
    process: ProcessSpec
    model: ModelSpec
    update: UpdateSpec
    cliprange_value: float
    micro_batch_size_for_experience: int


@dataclass(frozen=True)
class RolloutRoleSpec:
    """A worker that only generates (`easyrl.workers.rollout_role`): the actor's engine settings, in a process of its
    own."""

    process: ProcessSpec
    rollout: RolloutSpec
    memory_levers: MemoryLevers


@dataclass(frozen=True)
class SFTSpec:
    """The policy trained by supervised fine-tuning (`easyrl sft`): the actor's model, optimizer and forward settings,
    one optimizer step per call, the next-token loss over the trained tokens."""

    process: ProcessSpec
    model: ModelSpec
    update: UpdateSpec
    """`mini_batch_size`: this rank's rows of one optimizer step (global_batch_size / data-parallel size)."""
    micro_batch_size_for_experience: int
    """Rows per forward pass of validation (a fixed count; dynamic batching uses the token budget instead)."""
