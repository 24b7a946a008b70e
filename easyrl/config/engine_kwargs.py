"""`worker.rollout.engine_kwargs`: the engine's extra constructor arguments, and the ones easyrl owns.

One validated mapping instead of a flat easyrl key per vLLM option. Checked here, on the driver before any worker
starts and without importing vLLM: an argument easyrl sets or derives itself is refused, naming the easyrl key that
sets it (two keys for one setting would leave a run's record ambiguous about which one won); the `hf` engine takes
none. A name the installed vLLM does not know is refused where vLLM is imported anyway: the engine's constructor and
`easyrl check` (`easyrl.rollout.vllm_args.check_engine_arg_names`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from easyrl.config.errors import ConfigError


if TYPE_CHECKING:
    from easyrl.config.worker import RolloutConfig

KEY = "worker.rollout.engine_kwargs"

_LORA = "set worker.actor.model.lora.rollout_sync: adapter (vLLM then serves the adapters of lora.rank) instead"
VLLM_OWNED: dict[str, str] = {
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
"""vLLM engine arguments easyrl sets or derives itself (`easyrl.rollout.vllm.VLLMRolloutEngine`), with the fix."""


def check_engine_kwargs(rollout: RolloutConfig) -> None:
    """Refuse, with one line naming the key and the fix, what `rollout.engine_kwargs` may not hold for its engine:
    for `vllm` an argument easyrl owns (`VLLM_OWNED`), for `hf` anything. A registered engine of the user's own gets
    them unchecked (they are its to read)."""
    kwargs = rollout.engine_kwargs
    if rollout.name == "hf" and kwargs:
        raise ConfigError(
            KEY,
            f"the hf engine (transformers' generate) takes no engine arguments, got {', '.join(map(str, kwargs))}: "
            "remove them, or use worker.rollout.name=vllm",
        )
    if rollout.name != "vllm":
        return
    for name in kwargs:
        if name in VLLM_OWNED:
            raise ConfigError(f"{KEY}.{name}", f"easyrl sets this vLLM argument itself: {VLLM_OWNED[name]}")
