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
  log-softmax and gradient, or with the fused head one chunk of ``logprob_chunk_size`` tokens x V x 8; with
  ``defer_gradient_sync`` on several ranks, each rank's unsharded gradients in ``mp_reduce_dtype`` besides; and
  FSDP2's all-gathered copies in ``mp_param_dtype`` of the units the head's backward needs (`gathered_weights`);
- the engine: ``gpu_memory_utilization`` x the device, of which its weights (the parameters in the rollout dtype,
  split over tensor parallel) and the rest at most the KV cache; an engine that reserves no budget (the HF engine:
  `EngineCapabilities.reserves_budget`) holds its weights, and while a call runs that call's KV cache at full length
  and a decoding step's logits.

- the engine: ``gpu_memory_utilization`` x the device. vLLM (since 0.21) profiles the CUDA graphs it will capture and
  subtracts them from that budget, so its KV cache is the budget less its weights and the graphs
  (`cuda_graph_bytes`: an estimate from the sizes it captures and the model's shape; ``enforce_eager`` captures
  none). The graphs' pool is not part of what sleep
  unmaps: it stays on the GPU through the update;
- per process on the GPU (actor with its engine, reference unless LoRA serves it, critic): a CUDA context with its
  library workspaces (`CUDA_CONTEXT_BYTES`), and NCCL's buffers when there are several ranks (`NCCL_BYTES`);
- on the host: a level-1 sleep copies the engine's weights to pinned CPU memory (``pinned_host``), per GPU.

Two moments must fit: generating (the engine awake, the training state that is not offloaded still resident) and
the update (the engine asleep but its CUDA graphs resident, the actor's whole training state plus its activations,
the reference's weights). `plan_fixes` says which single setting makes a plan that does not fit fit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from easyrl.config.engines import engine_capabilities


GiB = 2**30
MiB = 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CUDA_CONTEXT_BYTES = GiB // 2
"""A CUDA context with cuBLAS/cuDNN workspaces and the loaded kernels, per process (~0.5 GiB as nvidia-smi shows
for a process that has done one matmul; an estimate, to be measured by the GPU checks)."""
NCCL_BYTES = 256 * MiB
"""NCCL's communicator buffers per process once it talks to other ranks (an estimate: 4 MiB per channel and
protocol for a few peers and channels; none with one rank)."""
GRAPH_BYTES_PER_LAYER = 384 * 1024
"""Per captured batch size and decoder layer: what a CUDA graph's own nodes and its piecewise pieces cost beside the
shared pool (`cuda_graph_bytes`). Calibrated, not measured alone: see `RECORDED_GRAPH_GIB`."""
RECORDED_GRAPH_GIB = 0.49
"""The one figure measured (docs/benchmarks.md, 0.5B on an H100 that reports 79.2 GiB, vLLM 0.26, utilization 0.5,
vLLM's default 51 capture sizes up to 512): the engine logged a KV cache of 3,336,400 tokens (x 12,288 bytes = 38.18
GiB) and 0.93 GiB of weights in its 39.6 GiB, which leaves 0.49 GiB (+-0.05, the log's rounding) for the CUDA
graphs and the profile run's transient peak together. The estimate counts it all as graphs (the safe side); the 1
GiB constant that stood here before was a guess, never measured."""


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
    vision_parameters: int = 0
    """Parameters of a vision-language model's vision tower and merger (`vision_parameter_count`); 0 for text."""
    attention_layers: int | None = None
    """Layers that keep a KV cache (full attention); None: all of them. Qwen3.5's linear-attention layers keep a
    fixed-size recurrent state per sequence instead, which the plan leaves out (a few MiB per sequence)."""
    counted_parameters: int = 0
    """The whole model's parameters counted on the meta device (`counted_parameter_count`), for the families the
    dense formula of `parameter_count` does not describe (routed experts, linear attention); 0: use the formula."""

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """The text model of a HF config, plus a vision-language model's tower (`vision_parameter_count`)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        from easyrl.models.family import family_of

        family = family_of(config)
        bias = getattr(text, "attention_bias", None)
        layer_types = list(getattr(text, "layer_types", None) or [])
        experts = int(getattr(text, "num_experts", 0) or 0)
        if experts:
            # A token passes its top-k experts (and a shared expert where there is one): that is its MLP working set
            routed = int(text.num_experts_per_tok) * int(text.moe_intermediate_size)
            mlp = routed + int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
        else:
            mlp = int(text.intermediate_size)
        # Linear-attention layers have their own projections and the MoE layers hold every expert: counted on the meta
        # device rather than by a formula per family
        # (and an Omni thinker's audio encoder sits beside its vision tower)
        irregular = experts > 0 or "linear_attention" in layer_types or family.thinker
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=mlp,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias if bias is None else bool(bias),  # Qwen2 always has q/k/v biases
            qk_norm=family.qk_norm,
            vision_parameters=vision_parameter_count(config),
            attention_layers=sum(t == "full_attention" for t in layer_types) if layer_types else None,
            counted_parameters=counted_parameter_count(config) if irregular else 0,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers whose keys and values the engine caches."""
        return self.num_layers if self.attention_layers is None else self.attention_layers

    def parameter_count(self) -> int:
        """Embedding, layers (attention, SwiGLU MLP, two RMSNorms), final norm, and the head unless tied (or the
        meta-device count of a MoE or hybrid model)."""
        if self.counted_parameters:
            return self.counted_parameters
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embedding = self.vocab_size * h
        text = self.num_layers * layer + embedding + h + (0 if self.tie_word_embeddings else embedding)
        return text + self.vision_parameters


def counted_parameter_count(config: Any) -> int:
    """Parameters of the whole model of a HF config (vision tower included), counted on a model built on the meta
    device (no memory, no download)."""
    import torch

    from easyrl.models.vision import model_class_for

    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def vision_parameter_count(config: Any) -> int:
    """Parameters of the vision tower (``visual``, with its merger) of a HF vision-language config, counted on a
    model built on the meta device (no memory, no download); 0 for a text model."""
    import torch

    from easyrl.models import is_vision_language, vision_tower
    from easyrl.models.vision import model_class_for

    if not is_vision_language(config):
        return 0
    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
    tower = vision_tower(model)
    return 0 if tower is None else sum(p.numel() for p in tower.parameters())


@dataclass(frozen=True)
class TrainingMemory:
    """One role's training memory on one GPU (bytes)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    accumulated_grads: int = 0
    """Unsharded gradients held between micro-batches when their reduction waits for the last one
    (`worker.actor.defer_gradient_sync`), in ``mp_reduce_dtype``: FSDP2 upcasts and keeps them until it reduces."""
    gathered: int = 0
    """FSDP2's all-gathered working copies of the sharded weights, in ``mp_param_dtype``, at the update's peak
    (`gathered_weights`)."""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.accumulated_grads + self.gathered


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU must hold (bytes); see the module docstring for each estimate."""

    parameters: int
    tokens_per_micro_batch: int
    actor: TrainingMemory
    ref_weights: int
    critic: TrainingMemory | None
    engine: int
    """The engine's budget, ``gpu_memory_utilization`` x the device: weights + CUDA graphs + KV cache (vLLM); an
    engine that reserves none: its weights + one call's KV cache and logits (`engine_rows`)."""
    engine_weights: int
    cuda_graphs: int
    """vLLM's CUDA-graph pool (inside the engine's budget; not freed by sleep)."""
    kv_cache_tokens: int
    processes: int
    """Processes on the GPU: actor (with the engine), reference, critic."""
    per_process: int
    """CUDA context (+ NCCL buffers with several ranks) of all those processes."""
    pinned_host: int
    """Host memory a level-1 sleep pins for the engine's weights (0 at level 2 or without sleep)."""
    device_total: int
    generating: int
    """Engine plus the training state that stays on the GPU while it generates, plus the processes' contexts."""
    updating: int
    """The actor's update plus what the other roles keep on the GPU meanwhile, the CUDA graphs and the contexts."""
    capture_sizes: tuple[int, ...] = ()
    """The batch sizes vLLM captures CUDA graphs for (`engine_capture_sizes`), which `cuda_graphs` is sized from."""
    engine_rows: int = 0
    """An engine that reserves no budget (`EngineCapabilities.reserves_budget` False, the HF engine): the rows of one
    call, whose KV cache at full length `kv_cache_tokens` counts; 0 for vLLM."""

    @property
    def kv_cache(self) -> int:
        return max(0, self.engine - self.engine_weights - self.cuda_graphs)

    @property
    def fits(self) -> bool:
        return self.kv_cache > 0 and max(self.generating, self.updating) <= self.device_total


def _sharded(numel: int, bytes_per: int, ranks: int) -> int:
    return -(-numel // ranks) * bytes_per


def _layer_working_set(shape: ModelShape, tokens: int, act: int) -> int:
    """One decoder layer's intermediates for `tokens` tokens in `act`-byte activations (see the module docstring)."""
    h = shape.hidden_size
    return tokens * (3 * h + 2 * shape.q_size + 2 * shape.kv_size + 3 * shape.intermediate_size) * act


def layer_activations(shape: ModelShape, tokens: int, act: int, checkpointing: bool) -> int:
    """What the backward pass keeps of the decoder layers for `tokens` tokens: each layer's input plus one layer's
    working set with gradient checkpointing, every layer's working set without it."""
    working = _layer_working_set(shape, tokens, act)
    if checkpointing:
        return shape.num_layers * tokens * shape.hidden_size * act + working
    return shape.num_layers * working


def forward_only_activations(shape: ModelShape, tokens: int, act: int) -> int:
    """A forward pass with no graph (old and reference log-probs) over `tokens` tokens: the residual stream and one
    layer's working set at a time (each layer's intermediates are freed as the next runs), without the head."""
    return tokens * shape.hidden_size * act + _layer_working_set(shape, tokens, act)


def head_activations(shape: ModelShape, actor: Any, tokens: int, backward: bool = True) -> int:
    """The log-prob head's bytes for a micro-batch of `tokens` tokens: bf16 logits with their fp32 log-softmax and
    gradient, or with the fused head one chunk of ``logprob_chunk_size`` tokens x V x 8 (the Triton kernel's chunk
    stays in the model's dtype: x V x 2 in bf16). `backward`: the update's micro-batch, which also builds the head
    weight's gradient (`head_weight_grad`); a forward-only pass does not."""
    act = DTYPE_BYTES[actor.fsdp.mp_param_dtype]
    fused = actor.fused_logprobs
    triton = fused and getattr(actor, "fused_head_kernel", "torch") == "triton"
    head_tokens = min(tokens, actor.logprob_chunk_size) if fused else tokens
    per_token = act if triton else 8 if fused else act + 8
    weight_grad = head_weight_grad(shape, actor, tokens, fused) if backward else 0
    return head_tokens * shape.vocab_size * per_token + weight_grad


def head_weight_grad(shape: ModelShape, actor: Any, tokens: int, fused: bool = True) -> int:
    """The head's (V, H) weight gradient at its backward's peak, which sits on top of every activation the backward
    still holds (it is the first op the backward runs): act bytes per weight, on every head. Unfused, autograd makes
    it in the model's dtype; the fused heads write each block of vocabulary columns of it once
    (`easyrl.workers.head_grad`: no fp32 (V, H) sum). Over several blocks (more tokens than
    ``logprob_chunk_size``) of a bf16 weight they sum the hidden states' gradient instead: an fp32 (T, H) sum and
    one block's (T, H) product. A LoRA actor's head gets no gradient (its adapters are in the decoder layers)."""
    if actor.model.lora.rank > 0:
        return 0
    act = DTYPE_BYTES[actor.fsdp.mp_param_dtype]
    grad = shape.vocab_size * shape.hidden_size * act
    if fused and tokens > actor.logprob_chunk_size and act < 4:
        grad += tokens * shape.hidden_size * (4 + act)
    return grad


def gathered_weights(shape: ModelShape, role: Any, params: int, lm_head: bool = True) -> int:
    """What FSDP2 has all-gathered (cast to ``mp_param_dtype``, on the GPU even with offload: the gathered copy is
    what the kernels read) at the update's peak, the head's backward, its first op.

    With ``enable_full_shard`` (`reshard_after_forward=True`, `easyrl.workers.model_setup.shard_model`) each unit is
    gathered for its forward and again for its backward: then the root unit (the embeddings, an untied head, the
    final norm) for the head's backward, and the last decoder layer, which FSDP2 prefetches for its backward (two
    layers counted: the one computing and the one prefetched). Even on one rank: the gathered copy is the cast.
    Without it every unit stays gathered from its forward to its backward: the whole model. A vision tower's blocks
    are units of their own, gathered around their own forward and backward, not at the head's. `lm_head` False: a
    critic's model (a one-output value head instead of the V x H one)."""
    act = DTYPE_BYTES[role.fsdp.mp_param_dtype]
    if not role.fsdp.enable_full_shard:
        return params * act
    h = shape.hidden_size
    embeddings = shape.vocab_size * h * (2 if lm_head and not shape.tie_word_embeddings else 1)
    root = embeddings + h
    layer = max(0, params - shape.vision_parameters - root) // max(1, shape.num_layers)
    return (root + 2 * layer) * act


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """The adapters of `all-linear` LoRA of `rank` (`easyrl.workers.lora`): rank x (in + out) for each of a decoder
    layer's attention projections (q, k, v, o) and MLP projections (gate, up, down), in every layer. The default
    targets leave the vision tower, routed experts and routers alone; a MoE model is counted as dense at its MLP
    working-set width, a linear-attention layer as an attention one (both on the safe side: no more than a few
    percent of the adapters). A comma list of targets is a subset of these."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * shape.num_layers


def _training(
    shape: ModelShape, role: Any, params: int, ranks: int, tokens: int, head: int, lm_head: bool = True
) -> TrainingMemory:
    """`role`: the actor's or critic's config. `head`: bytes of the output head's activations. A frozen vision tower
    keeps its weights but gets no gradients and no optimizer state; with LoRA only the adapters (and a critic's
    value head, `lm_head` False) get them: the base is frozen."""
    master = DTYPE_BYTES[role.fsdp.torch_dtype or "fp32"]
    act = DTYPE_BYTES[role.fsdp.mp_param_dtype]
    on_gpu = not role.fsdp.enable_cpu_offload
    trained = params - (shape.vision_parameters if getattr(role.model, "freeze_vision_tower", False) else 0)
    if role.model.lora.rank > 0:
        trained = lora_parameters(shape, role.model.lora.rank) + (0 if lm_head else shape.hidden_size + 1)
    moments = 2 * (DTYPE_BYTES["bf16"] if role.optim.strategy == "adamw_bf16" else master)
    # auto (null) is resolved before a run plans (`easyrl.update_levers`); unresolved it counts as on, the safe side
    checkpointing = role.model.enable_gradient_checkpointing is not False
    deferred = ranks > 1 and bool(getattr(role, "defer_gradient_sync", False))
    return TrainingMemory(
        weights=_sharded(params, master, ranks) if on_gpu else 0,
        grads=_sharded(trained, master, ranks) if on_gpu else 0,
        optimizer=_sharded(trained, moments, ranks) if on_gpu else 0,
        activations=layer_activations(shape, tokens, act, checkpointing) + head,
        accumulated_grads=trained * DTYPE_BYTES[role.fsdp.mp_reduce_dtype] if deferred else 0,
        gathered=gathered_weights(shape, role, params, lm_head),
    )


def cuda_graph_bytes(shape: ModelShape, sizes: list[int], act: int) -> int:
    """vLLM's CUDA-graph pool for graphs captured at `sizes` (tokens; `easyrl.rollout.vllm_args.capture_sizes`) with
    `act`-byte activations. vLLM profiles it the same way (`GPUModelRunner.profile_cudagraph_memory`): the first
    (largest) capture allocates the pool that every smaller graph reuses, each further graph adds its own overhead.
    Assumed: the pool holds the largest batch's intermediates, one layer's working set plus each layer's output (a
    piecewise graph keeps the residual stream between its pieces), in the engine's dtype, tensor parallelism ignored
    (the safe side); the overhead grows with the layers (a graph's nodes are the layers' kernels), at
    `GRAPH_BYTES_PER_LAYER`, calibrated on the one measured figure (`RECORDED_GRAPH_GIB`). 0 when nothing is captured."""
    if not sizes:
        return 0
    largest = max(sizes)
    pool = _layer_working_set(shape, largest, act) + shape.num_layers * largest * shape.hidden_size * act
    return pool + len(sizes) * shape.num_layers * GRAPH_BYTES_PER_LAYER


def engine_capture_sizes(cfg: Any) -> list[int]:
    """The sizes the run's vLLM engine captures graphs for on CUDA (its `max_num_batched_tokens` as vllm.py sets it,
    at least the context length); [] for an engine without CUDA graphs."""
    from easyrl.config.engine_kwargs import sequences_per_engine_call
    from easyrl.rollout.vllm_args import capture_sizes

    rollout, data = cfg.worker.rollout, cfg.data
    if not engine_capabilities(rollout.name).cuda_graphs:
        return []
    context = rollout.max_model_len or data.max_prompt_length + data.max_response_length
    budget = max(rollout.max_num_batched_tokens, context)
    return capture_sizes(rollout, sequences_per_engine_call(cfg), budget)


def _micro_batch_tokens(cfg: Any) -> int:
    actor, d = cfg.worker.actor, cfg.data
    if actor.dynamic_batching:
        return int(actor.max_token_len_per_gpu)
    # a sequence-parallel group splits each micro-batch's tokens over its ulysses_size ranks
    per_rank = actor.micro_batch_size_per_device_for_update * (d.max_prompt_length + d.max_response_length)
    return int(per_rank // actor.ulysses_size)


def plan_memory(shape: ModelShape, cfg: Any, device_total: int) -> MemoryPlan:
    """The per-GPU plan of the run `cfg` (an `EasyRLConfig`) on GPUs of `device_total` bytes: its roles, ranks, tensor
    parallelism and sleep level as the run plan decides them (`easyrl.trainer.plan`)."""
    from easyrl.config.engine_kwargs import sequences_per_engine_call
    from easyrl.trainer.plan import plan_of

    run = plan_of(cfg)
    w = cfg.worker
    ranks = run.world_size
    actor = w.actor
    tokens = _micro_batch_tokens(cfg)
    params = shape.parameter_count()
    head = head_activations(shape, actor, tokens)
    actor_mem = _training(shape, actor, params, ranks, tokens, head)
    # the reference is a process of its own, unless the LoRA actor serves it (its base, adapters off)
    ref_process = run.ref_worker
    ref_weights = _sharded(params, DTYPE_BYTES[w.ref.fsdp.torch_dtype or "fp32"], ranks) if ref_process else 0
    critic = None
    if run.critic:
        critic_params = params - shape.vocab_size * shape.hidden_size
        critic = _training(shape, w.critic, critic_params, ranks, tokens, 0, lm_head=False)
    rollout = w.rollout
    caps = engine_capabilities(rollout.name)
    tp = run.ranks_per_engine
    engine_dtype = DTYPE_BYTES[rollout.dtype]
    engine_weights = -(-params // tp) * engine_dtype
    sizes = engine_capture_sizes(cfg)
    graphs = cuda_graph_bytes(shape, sizes, engine_dtype)
    kv_per_token = 2 * shape.kv_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * engine_dtype
    sleeps = bool(caps.sleep_levels) and rollout.enable_sleep_mode
    rows = 0
    if caps.reserves_budget:  # vLLM: its budget, taken at start; the KV cache is what weights and graphs leave
        engine = int(rollout.gpu_memory_utilization * device_total)
        kv_tokens = max(0, engine - engine_weights - graphs) // kv_per_token
        held_while_updating = graphs if sleeps else engine
    else:  # the HF engine: its weights, and in each call the KV cache of that call's rows at full length
        rows = sequences_per_engine_call(cfg)
        kv_tokens = rows * (cfg.data.max_prompt_length + cfg.data.max_response_length)
        # a decoding step's fp32 next-token logits, their log-softmax and a processor's copy: rows x V x 4, 3 times
        engine = engine_weights + kv_tokens * kv_per_token + 3 * rows * shape.vocab_size * 4
        held_while_updating = engine_weights  # the call's cache is freed when it returns
    processes = 1 + int(ref_process) + int(critic is not None)
    per_process = processes * (CUDA_CONTEXT_BYTES + (NCCL_BYTES if ranks > 1 else 0))
    off = actor.offload
    resident = (0 if off.offload_params else actor_mem.weights) + (0 if off.offload_optimizer else actor_mem.optimizer)
    ref_resident = 0 if w.ref.offload.offload_params else ref_weights
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
        cuda_graphs=graphs,
        kv_cache_tokens=kv_tokens,
        processes=processes,
        per_process=per_process,
        pinned_host=engine_weights if sleeps and run.sleep_level == 1 else 0,
        device_total=device_total,
        generating=engine + resident + ref_resident + critic_resident + per_process,
        # asleep, vLLM still holds its CUDA graphs (without sleep mode, all of its budget); the HF engine its weights
        updating=actor_mem.total + ref_resident + critic_resident + per_process + held_while_updating,
        capture_sizes=tuple(sizes),
        engine_rows=rows,
    )


def _g(value: int) -> str:
    return f"{value / GiB:.1f}"


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan as `easyrl check` prints it (GiB)."""
    a = plan.actor
    lines = [
        f"model: {plan.parameters / 1e9:.2f}B parameters; device: {_g(plan.device_total)} GiB",
        f"actor update: weights {_g(a.weights)} + grads {_g(a.grads)} + optimizer {_g(a.optimizer)} + activations "
        f"{_g(a.activations)} ({plan.tokens_per_micro_batch} tokens per micro-batch)"
        + (f" + unsharded gradients {_g(a.accumulated_grads)}" if a.accumulated_grads else "")
        + f" + gathered weights {_g(a.gathered)} = {_g(a.total)} GiB",
    ]
    if plan.ref_weights:
        lines.append(f"reference: weights {_g(plan.ref_weights)} GiB")
    if plan.critic is not None:
        lines.append(f"critic: {_g(plan.critic.total)} GiB while it trains")
    if plan.engine_rows:
        engine = (
            f"engine: {_g(plan.engine)} GiB while it generates (weights {_g(plan.engine_weights)} + one call's "
            f"{plan.engine_rows} rows at full length, {plan.kv_cache_tokens} tokens: KV cache and a step's logits "
            f"{_g(plan.kv_cache)}, freed when the call returns)"
        )
    else:
        engine = (
            f"engine: {_g(plan.engine)} GiB (weights {_g(plan.engine_weights)} + CUDA graphs {_g(plan.cuda_graphs)}"
            + (
                f" for {len(plan.capture_sizes)} batch sizes up to {max(plan.capture_sizes)}"
                if plan.capture_sizes
                else ""
            )
            + f" + KV cache {_g(plan.kv_cache)}, about {plan.kv_cache_tokens} tokens)"
        )
    stays = "weights" if plan.engine_rows else "CUDA graphs"
    lines += [
        engine,
        f"processes on the GPU: {plan.processes}, their CUDA contexts and NCCL buffers {_g(plan.per_process)} GiB",
        f"while generating: {_g(plan.generating)} of {_g(plan.device_total)} GiB",
        f"while updating: {_g(plan.updating)} of {_g(plan.device_total)} GiB (the engine's {stays} stay)",
    ]
    if plan.pinned_host:
        lines.append(f"host: {_g(plan.pinned_host)} GiB pinned per GPU for the engine's weights (sleep level 1)")
    return lines


def plan_problems(plan: MemoryPlan) -> list[str]:
    """Why the plan cannot fit, one line each with its arithmetic (empty when it fits)."""
    problems = []
    if plan.kv_cache <= 0:
        problems.append(
            f"the engine's weights ({_g(plan.engine_weights)} GiB) and CUDA graphs ({_g(plan.cuda_graphs)} GiB) leave "
            f"no KV cache in its {_g(plan.engine)} GiB: raise worker.rollout.gpu_memory_utilization or "
            "worker.rollout.tensor_parallel_size"
        )
    a = plan.actor
    if plan.generating > plan.device_total:
        problems.append(
            f"generating needs {_g(plan.generating)} of {_g(plan.device_total)} GiB (engine {_g(plan.engine)} + actor "
            f"weights {_g(a.weights)} + optimizer {_g(a.optimizer)} + reference {_g(plan.ref_weights)} + "
            f"critic and contexts): "
            + (
                "fewer rows per engine call (data.rollout_batch_size, worker.rollout.n) or shorter ones"
                if plan.engine_rows
                else "lower worker.rollout.gpu_memory_utilization"
            )
            + ", or offload while generating (worker.actor.offload.*, worker.ref.offload.offload_params)"
        )
    if plan.updating > plan.device_total:
        problems.append(
            f"the update needs {_g(plan.updating)} of {_g(plan.device_total)} GiB: lower "
            "worker.actor.max_token_len_per_gpu (or the micro-batch size), use worker.actor.optim.strategy=adamw_bf16, "
            "more GPUs, or worker.ref.offload.offload_params"
        )
    return problems


def _offload_actor(worker: Any) -> None:
    worker.actor.offload.offload_params = True
    worker.actor.offload.offload_optimizer = True


LEVERS: dict[str, Callable[[Any], None]] = {
    "worker.actor.optim.strategy=adamw_bf16": lambda w: setattr(w.actor.optim, "strategy", "adamw_bf16"),
    "worker.ref.fsdp.torch_dtype=bf16": lambda w: setattr(w.ref.fsdp, "torch_dtype", "bf16"),
    "worker.actor.offload.offload_params=true worker.actor.offload.offload_optimizer=true": _offload_actor,
}
"""The settings that shrink a plan, each as the overrides that set it and how it changes a config's worker section."""


def plan_fixes(shape: ModelShape, cfg: Any, device_total: int) -> list[str]:
    """For a plan that does not fit, the levers that make it fit, one line each: each single setting of `LEVERS`
    that is not already on, the highest ``gpu_memory_utilization`` that fits, and all of them together."""
    plan = plan_memory(shape, cfg, device_total)
    if plan.fits:
        return []
    fixes, combined = [], copy.deepcopy(cfg)
    for overrides, apply in LEVERS.items():
        trial = copy.deepcopy(cfg)
        apply(trial.worker)
        apply(combined.worker)
        after = plan_memory(shape, trial, device_total)
        if max(after.generating, after.updating) < max(plan.generating, plan.updating) and after.fits:
            fixes.append(f"{overrides}: generating {_g(after.generating)}, updating {_g(after.updating)} GiB")
    # the engine's budget is what generating needs beyond the rest: the largest that still fits, if it holds a KV cache
    room = device_total - (plan.generating - plan.engine)
    utilization = int(room / device_total * 100) / 100  # rounded down to a hundredth
    lower = copy.deepcopy(cfg)
    lower.worker.rollout.gpu_memory_utilization = utilization
    after = plan_memory(shape, lower, device_total)
    if not plan.engine_rows and 0 < utilization < cfg.worker.rollout.gpu_memory_utilization and after.fits:
        fixes.append(f"worker.rollout.gpu_memory_utilization={utilization}: KV cache {_g(after.kv_cache)} GiB")
    if not fixes:
        after = plan_memory(shape, combined, device_total)
        verdict = "fits" if after.fits else "still does not fit: use more GPUs"
        fixes.append(f"no single lever fits; all of {', '.join(LEVERS)} together: {verdict}")
    return fixes
