"""What each rollout engine can do, declared where it is registered and read everywhere else instead of its name.

`easyrl.rollout.register_engine(name, capabilities=...)` declares an engine here, so that the config validator, the
memory plan, `easyrl check` and the trainer's set-up know what it can do without importing it (torch-free, like
`config.names`). The built-ins' records are written below because the validator needs them before the registry is
ever imported; `rollout/registry.py` registers each built-in with its record (an assertion there keeps the two equal).
A config that asks an engine for what it does not declare is refused in one line naming the key, the engine and the
fix (`check_engine_capabilities`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from easyrl.config.diffusion_run import is_diffusion_run
from easyrl.config.errors import ConfigError


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig


@dataclass(frozen=True)
class EngineCapabilities:
    """What a rollout engine can do. The defaults are what a plain `RolloutEngine` subclass can: one process per
    engine, processed media only, merged LoRA weights only, no sleep levels, any `engine_kwargs` (its own to read)."""

    tensor_parallel: bool = False
    """One engine may span `worker.rollout.tensor_parallel_size` consecutive workers, which are given the same
    prompts (`ranks_per_engine`). Without it a size above 1 is refused."""
    raw_media: bool = False
    """Takes a prompt's images and videos as they are (`rollout_prompt`) and processes the pixels itself; without it
    the engine gets the processor's tensors (`multi_modal_inputs`)."""
    lora_adapters: bool = False
    """Serves LoRA adapters over its base weights (`RolloutEngine.load_adapter`): `lora.rollout_sync: adapter`."""
    max_lora_rank: int | None = None
    """The largest LoRA rank it serves as an adapter; None: no limit."""
    sleep_levels: tuple[int, ...] = ()
    """The `worker.rollout.sleep_level`s it has; empty: it never frees its memory while the policy trains."""
    cuda_graphs: bool = False
    """Captures CUDA graphs out of its `gpu_memory_utilization` budget (unless `enforce_eager`), which stay on the
    GPU while it sleeps: the memory plan counts them."""
    reserves_budget: bool = False
    """Takes `worker.rollout.gpu_memory_utilization` x the device when it starts (vLLM: weights, CUDA graphs and a
    KV-cache pool) and keeps it, asleep or not. False: it holds its weights and allocates each call's KV cache in
    that call (`easyrl.memory_plan` plans it from the call's rows, not from the utilization)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables it needs in every worker process (set when Ray starts)."""
    cpu_env: tuple[tuple[str, str], ...] = ()
    """More of them on a run without GPUs."""
    engine_kwargs: bool = True
    """Takes `worker.rollout.engine_kwargs`; False refuses any."""
    owned_engine_kwargs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Engine arguments easyrl sets or derives itself, each with the fix; `engine_kwargs` may not hold them."""
    inline: bool = True
    """May run in the driver's own process (`trainer.backend: inline`); False keeps its runs on Ray."""
    generates_text: bool = True
    """Samples token responses from token prompts; False: an image / video generator that samples from the prompts'
    text (a diffusion pipeline, docs/diffusion.md), serving only diffusion runs."""


_LORA = "set worker.actor.model.lora.rollout_sync: adapter (vLLM then serves the adapters of lora.rank) instead"
VLLM_OWNED: Mapping[str, str] = MappingProxyType(
    {
        "model": "set worker.actor.model.model_path instead",
        "tokenizer": "set worker.actor.model.tokenizer_path instead",
        "skip_tokenizer_init": "easyrl sends token ids, and starts the tokenizer for models with images or videos; "
        "remove it",
        "trust_remote_code": "set worker.actor.model.trust_remote_code instead",
        "dtype": "set worker.rollout.dtype instead",
        "seed": "set worker.rollout.seed instead",
        "max_model_len": "set worker.rollout.max_model_len instead",
        "enforce_eager": "set worker.rollout.enforce_eager instead",
        "logprobs_mode": "easyrl asks for processed_logprobs (after temperature: what the actor computes); remove it",
        "tensor_parallel_size": "set worker.rollout.tensor_parallel_size instead",
        "distributed_executor_backend": "easyrl runs a tensor-parallel engine inside the workers' own processes "
        "(external_launcher, worker.rollout.tensor_parallel_size); remove it",
        "disable_custom_all_reduce": "easyrl sets it with worker.rollout.tensor_parallel_size > 1 (each Ray worker "
        "sees only its own GPU); remove it",
        "max_num_batched_tokens": "set worker.rollout.max_num_batched_tokens instead",
        "enable_chunked_prefill": "set worker.rollout.enable_chunked_prefill instead",
        "gpu_memory_utilization": "set worker.rollout.gpu_memory_utilization instead",
        "enable_sleep_mode": "set worker.rollout.enable_sleep_mode (and sleep_level) instead",
        "limit_mm_per_prompt": "easyrl derives it from the data (the most images / videos one prompt carries; "
        "data.limit_images bounds them); remove it",
        "enable_lora": _LORA,
        "max_lora_rank": _LORA,
        "max_loras": _LORA,
    }
)
"""vLLM engine arguments easyrl sets or derives itself (`easyrl.rollout.vllm.VLLMRolloutEngine`), with the fix."""

BUILTIN_ENGINE_CAPABILITIES: Mapping[str, EngineCapabilities] = MappingProxyType(
    {
        # transformers' generate in the worker's own process: any device, processed media, merged weights
        "hf": EngineCapabilities(engine_kwargs=False),
        "vllm": EngineCapabilities(
            tensor_parallel=True,  # vLLM's external launcher in the workers' own process group
            raw_media=True,
            lora_adapters=True,
            max_lora_rank=512,
            sleep_levels=(1, 2),
            cuda_graphs=True,
            reserves_budget=True,
            # the engine core in the worker's process (easyrl drives it step by step), and its log kept short
            env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_LOGGING_LEVEL", "WARNING")),
            cpu_env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),  # GiB of KV cache: the CPU build's default is 4
            owned_engine_kwargs=VLLM_OWNED,
            # Its process-wide state (parallel groups, the sleep-mode allocator) has not run in a driver's process,
            # nor two engines one after the other in one process: a Ray worker's process ends with its engine.
            inline=False,
        ),
        # a diffusers flow-matching pipeline in the worker's own process: one worker per engine, sleep moves it to
        # host memory (its weights stay: nothing to push again), samples images from the prompts' text
        "diffusers": EngineCapabilities(engine_kwargs=False, generates_text=False),
    }
)
"""The built-in engines' records: `easyrl.rollout.registry` registers each built-in with its entry here."""

# The engines declared so far, starting with the built-ins; `easyrl.rollout.registry` writes here as it registers.
_DECLARED: dict[str, EngineCapabilities] = dict(BUILTIN_ENGINE_CAPABILITIES)


def declare_engine(name: str, capabilities: EngineCapabilities) -> None:
    """Record an engine the registry has just registered, with what it can do (a re-registration replaces it)."""
    _DECLARED[name] = capabilities


def declared_engines() -> list[str]:
    """Sorted names of the rollout engines known so far (built-in and registered)."""
    return sorted(_DECLARED)


def engine_capabilities(name: str) -> EngineCapabilities:
    """What the engine `name` declared it can do: the one lookup every reader goes through."""
    try:
        return _DECLARED[name]
    except KeyError:
        raise KeyError(
            f"worker.rollout.name={name!r} is not a registered rollout engine; known: {', '.join(declared_engines())}"
            " (a user's engine registers itself with easyrl.rollout.register_engine in a file of "
            "algorithm.user_modules)"
        ) from None


def engines_with(wanted: str) -> str:
    """`worker.rollout.name=a` (or `=a or =b`) for the built-in engines that have the capability `wanted`, the fix a
    refusal suggests (a user's engines are the user's to know, and the line stays the same whatever is registered)."""
    names = [n for n, caps in sorted(BUILTIN_ENGINE_CAPABILITIES.items()) if getattr(caps, wanted)]
    return " or ".join(f"worker.rollout.name={n}" for n in names) or "an engine registered with it"


def check_engine_capabilities(cfg: EasyRLConfig) -> None:
    """Refuse, in one line naming the key, the engine and the fix, a config that asks `worker.rollout.name` for what
    the engine did not declare (never a silent fallback: a tensor-parallel size it would run at 1, say)."""
    rollout = cfg.worker.rollout
    caps = engine_capabilities(rollout.name)
    engine = f"the {rollout.name} engine"
    diffusion = is_diffusion_run(cfg)
    # a text engine cannot sample a pipeline, nor an image engine a language model
    if diffusion == caps.generates_text:
        raise ConfigError(
            "worker.rollout.name",
            f"{rollout.name}, but {engine} "
            + (
                "samples text and worker.actor.model.model_path is a diffusion pipeline: set it to diffusers"
                if diffusion
                else "samples images from a diffusion pipeline and worker.actor.model.model_path is not one (no "
                "model_index.json; worker.rollout.diffusion.enable): use worker.rollout.name=hf or =vllm"
            ),
        )
    if not caps.generates_text:
        _check_image_engine(cfg, engine)
    if rollout.tensor_parallel_size > 1 and not caps.tensor_parallel:
        raise ConfigError(
            "worker.rollout.tensor_parallel_size",
            f"{rollout.tensor_parallel_size}, but {engine} does not declare tensor parallelism (one engine per "
            f"worker): set it to 1, or use {engines_with('tensor_parallel')}",
        )
    if rollout.sleep_level is not None and rollout.sleep_level not in caps.sleep_levels:
        levels = ", ".join(map(str, caps.sleep_levels))
        raise ConfigError(
            "worker.rollout.sleep_level",
            f"must be {levels} or null (derived), got {rollout.sleep_level}"
            if caps.sleep_levels
            else f"{rollout.sleep_level}, but {engine} declares no sleep levels: remove it (null), or use "
            f"{engines_with('sleep_levels')}",
        )
    lora = cfg.worker.actor.model.lora
    if lora.rank > 0 and lora.rollout_sync == "adapter":
        key = "worker.actor.model.lora.rollout_sync"
        if not caps.lora_adapters:
            raise ConfigError(
                key,
                f"adapter, but {engine} does not declare LoRA adapters: use merged, or {engines_with('lora_adapters')}",
            )
        if caps.max_lora_rank is not None and lora.rank > caps.max_lora_rank:
            raise ConfigError(
                "worker.actor.model.lora.rank",
                f"{lora.rank}: {engine} serves LoRA ranks up to {caps.max_lora_rank} as adapters; use "
                "rollout_sync=merged",
            )


def _check_image_engine(cfg: EasyRLConfig, engine: str) -> None:
    """What an image engine's run cannot do: its trajectories are sampled whole by one policy (no carry-over across
    weight updates, which resumes token responses) and have no turns."""
    if cfg.trainer.max_staleness > 0:
        raise ConfigError(
            "trainer.max_staleness",
            f"{cfg.trainer.max_staleness}, but {engine} samples every trajectory whole with one policy: diffusion runs "
            "are synchronous, set it to 0",
        )
    if cfg.worker.rollout.multi_turn.enabled:
        raise ConfigError(
            "worker.rollout.multi_turn",
            f"an environment or tools are set, but {engine} samples images, which have no turns: remove them",
        )


def engine_env(name: str, on_gpu: bool) -> dict[str, str]:
    """The environment the engine `name` needs in every worker process."""
    caps = engine_capabilities(name)
    return dict(caps.env) | ({} if on_gpu else dict(caps.cpu_env))
