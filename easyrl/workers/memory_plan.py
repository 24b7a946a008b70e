"""The memory plan of a run, per GPU, from the model's config and ours: pure arithmetic, printed by `easyrl check`.

Estimates, in bytes, of what one GPU holds (the actor, reference and critic of a GPU share it with the engine):

- training state, sharded over the ranks by FSDP: master weights (``fsdp.torch_dtype``, fp32 when unset), gradients in
  the same dtype, AdamW's two moments (``optim.strategy``: adamw keeps them in the weights' dtype, adamw_bf16 in bf16);
  nothing on the GPU with ``fsdp.enable_cpu_offload``;
- activations of one micro-batch of T tokens (``max_token_len_per_gpu`` with dynamic batching, else
  ``micro_batch_size_per_device_for_update`` x the longest sequence), in ``mp_param_dtype``: with gradient
  checkpointing each layer's input (L x T x H) plus one layer's working set T x (3H + 2Q + 2KV + 3I) (norm outputs,
  q/k/v and the attention output, the MLP's gate, up and product; flash attention keeps no T x T matrix); without it,
  that working set for every layer. Plus the log-prob head: T x V x (2 + 8) bytes for bf16 logits with their fp32
  log-softmax and gradient, or with the fused head one chunk of ``logprob_chunk_size`` tokens x V x 8;
- the engine: ``gpu_memory_utilization`` x the device, of which its weights (the parameters in the rollout dtype,
  split over tensor parallel) and the rest at most the KV cache.

Two moments must fit: generating (the engine awake, the training state that is not offloaded still resident) and
the update (the engine asleep, the actor's whole training state plus its activations, the reference's weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that set its memory."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """The text model of a HF config (a vision-language model's vision tower is not counted)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        model_type = str(getattr(text, "model_type", ""))
        bias = getattr(text, "attention_bias", None)
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type.startswith("qwen2") if bias is None else bool(bias),  # Qwen2 always has q/k/v biases
            qk_norm=model_type.startswith("qwen3"),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def parameter_count(self) -> int:
        """Embedding, layers (attention, SwiGLU MLP, two RMSNorms), final norm, and the head unless tied."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embedding = self.vocab_size * h
        return self.num_layers * layer + embedding + h + (0 if self.tie_word_embeddings else embedding)


@dataclass(frozen=True)
class TrainingMemory:
    """One role's training memory on one GPU (bytes)."""

    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU must hold (bytes); see the module docstring for each estimate."""

    parameters: int
    tokens_per_micro_batch: int
    actor: TrainingMemory
    ref_weights: int
    critic: TrainingMemory | None
    engine: int
    engine_weights: int
    kv_cache_tokens: int
    device_total: int
    generating: int
    """Engine plus the training state that stays on the GPU while it generates."""
    updating: int
    """The actor's update plus what the other roles keep on the GPU meanwhile."""

    @property
    def kv_cache(self) -> int:
        return max(0, self.engine - self.engine_weights)


def _sharded(numel: int, bytes_per: int, ranks: int) -> int:
    return -(-numel // ranks) * bytes_per


def _training(shape: ModelShape, role: Any, params: int, ranks: int, tokens: int, head: int) -> TrainingMemory:
    """`role`: the actor's or critic's config. `head`: bytes of the output head's activations."""
    master = DTYPE_BYTES[role.fsdp.torch_dtype or "fp32"]
    act = DTYPE_BYTES[role.fsdp.mp_param_dtype]
    on_gpu = not role.fsdp.enable_cpu_offload
    weights = _sharded(params, master, ranks) if on_gpu else 0
    moments = 2 * (DTYPE_BYTES["bf16"] if role.optim.strategy == "adamw_bf16" else master)
    h = shape.hidden_size
    working = tokens * (3 * h + 2 * shape.q_size + 2 * shape.kv_size + 3 * shape.intermediate_size) * act
    if role.model.enable_gradient_checkpointing:
        activations = shape.num_layers * tokens * h * act + working
    else:
        activations = shape.num_layers * working
    return TrainingMemory(
        weights=weights,
        grads=weights,
        optimizer=_sharded(params, moments, ranks) if on_gpu else 0,
        activations=activations + head,
    )


def plan_memory(shape: ModelShape, cfg: Any, device_total: int) -> MemoryPlan:
    """The per-GPU plan of the run `cfg` (an `EasyRLConfig`) on GPUs of `device_total` bytes."""
    w, d = cfg.worker, cfg.data
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    actor = w.actor
    tokens = (
        actor.max_token_len_per_gpu
        if actor.dynamic_batching
        # a sequence-parallel group splits each micro-batch's tokens over its ulysses_size ranks
        else actor.micro_batch_size_per_device_for_update
        * (d.max_prompt_length + d.max_response_length)
        // actor.ulysses_size
    )
    params = shape.parameter_count()
    head_tokens = min(tokens, actor.logprob_chunk_size) if actor.fused_logprobs else tokens
    head = head_tokens * shape.vocab_size * (8 if actor.fused_logprobs else DTYPE_BYTES[actor.fsdp.mp_param_dtype] + 8)
    actor_mem = _training(shape, actor, params, ranks, tokens, head)
    need_ref = not cfg.algorithm.disable_kl
    ref_weights = _sharded(params, DTYPE_BYTES[w.ref.fsdp.torch_dtype or "fp32"], ranks) if need_ref else 0
    critic = None
    if cfg.algorithm.adv_estimator == "gae":
        critic = _training(shape, w.critic, params - shape.vocab_size * shape.hidden_size, ranks, tokens, 0)
    rollout = w.rollout
    tp = rollout.tensor_parallel_size if rollout.name == "vllm" else 1
    engine = int(rollout.gpu_memory_utilization * device_total)
    engine_dtype = DTYPE_BYTES[rollout.dtype]
    engine_weights = -(-params // tp) * engine_dtype
    kv_per_token = 2 * shape.num_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * engine_dtype
    kv_tokens = max(0, engine - engine_weights) // kv_per_token
    off = actor.offload
    resident = (0 if off.offload_params else actor_mem.weights) + (0 if off.offload_optimizer else actor_mem.optimizer)
    resident += 0 if w.ref.offload.offload_params else ref_weights
    critic_resident = 0
    if critic is not None:
        critic_resident = (0 if w.critic.offload.offload_params else critic.weights) + (
            0 if w.critic.offload.offload_optimizer else critic.optimizer
        )
    return MemoryPlan(
        parameters=params,
        tokens_per_micro_batch=tokens,
        actor=actor_mem,
        ref_weights=ref_weights,
        critic=critic,
        engine=engine,
        engine_weights=engine_weights,
        kv_cache_tokens=kv_tokens,
        device_total=device_total,
        generating=engine + resident + critic_resident,
        updating=actor_mem.total + (0 if w.ref.offload.offload_params else ref_weights) + critic_resident,
    )


def _g(value: int) -> str:
    return f"{value / GiB:.1f}"


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan as `easyrl check` prints it (GiB)."""
    a = plan.actor
    lines = [
        f"model: {plan.parameters / 1e9:.2f}B parameters; device: {_g(plan.device_total)} GiB",
        f"actor update: weights {_g(a.weights)} + grads {_g(a.grads)} + optimizer {_g(a.optimizer)} + activations "
        f"{_g(a.activations)} ({plan.tokens_per_micro_batch} tokens per micro-batch) = {_g(a.total)} GiB",
    ]
    if plan.ref_weights:
        lines.append(f"reference: weights {_g(plan.ref_weights)} GiB")
    if plan.critic is not None:
        lines.append(f"critic: {_g(plan.critic.total)} GiB while it trains")
    lines += [
        f"engine: {_g(plan.engine)} GiB (weights {_g(plan.engine_weights)} + KV cache {_g(plan.kv_cache)}, about "
        f"{plan.kv_cache_tokens} tokens)",
        f"while generating: {_g(plan.generating)} of {_g(plan.device_total)} GiB",
        f"while updating: {_g(plan.updating)} of {_g(plan.device_total)} GiB",
    ]
    return lines


def plan_problems(plan: MemoryPlan) -> list[str]:
    """Why the plan cannot fit, one line each (empty when it fits)."""
    problems = []
    if plan.engine_weights >= plan.engine:
        problems.append(
            f"the engine's weights ({_g(plan.engine_weights)} GiB) leave no KV cache in its "
            f"{_g(plan.engine)} GiB: raise worker.rollout.gpu_memory_utilization or worker.rollout.tensor_parallel_size"
        )
    if plan.generating > plan.device_total:
        problems.append(
            f"generating needs {_g(plan.generating)} of {_g(plan.device_total)} GiB: lower "
            "worker.rollout.gpu_memory_utilization, or offload while generating (worker.actor.offload.*, "
            "worker.ref.offload.offload_params)"
        )
    if plan.updating > plan.device_total:
        problems.append(
            f"the update needs {_g(plan.updating)} of {_g(plan.device_total)} GiB: lower "
            "worker.actor.max_token_len_per_gpu (or the micro-batch size), use worker.actor.optim.strategy=adamw_bf16, "
            "more GPUs, or worker.ref.offload.offload_params"
        )
    return problems
