"""`worker.rollout.engine_kwargs`: the engine's extra constructor arguments, and the ones easyrl owns.

One validated mapping instead of a flat easyrl key per vLLM option. Checked here, on the driver before any worker
starts and without importing vLLM: an argument easyrl sets or derives itself is refused, naming the easyrl key that
sets it (two keys for one setting would leave a run's record ambiguous about which one won); an engine that declares
none (`hf`) takes none (`config.engines`). A name the installed vLLM does not know is refused where vLLM is imported anyway: the engine's constructor and
`easyrl check` (`easyrl.rollout.vllm_args.check_engine_arg_names`). Also the batch one engine call is given
(`sequences_per_engine_call`), from which `easyrl.rollout.vllm_args.generation_args` derives the engine's CUDA-graph
capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from easyrl.config.engines import engine_capabilities, engines_with
from easyrl.config.errors import ConfigError


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig
    from easyrl.config.worker import RolloutConfig

KEY = "worker.rollout.engine_kwargs"


def check_engine_kwargs(rollout: RolloutConfig) -> None:
    """Refuse, with one line naming the key and the fix, what `rollout.engine_kwargs` may not hold for its engine
    (`config.engines.EngineCapabilities`): anything, for an engine that takes none (`hf`); an argument easyrl owns
    (`owned_engine_kwargs`: vLLM's `VLLM_OWNED`). A registered engine of the user's own gets them unchecked (they
    are its to read)."""
    kwargs = rollout.engine_kwargs
    caps = engine_capabilities(rollout.name)
    if not caps.engine_kwargs and kwargs:
        raise ConfigError(
            KEY,
            f"the {rollout.name} engine takes no engine arguments, got {', '.join(map(str, kwargs))}: remove them, "
            f"or use {engines_with('engine_kwargs')}",
        )
    for name in kwargs:
        if name in caps.owned_engine_kwargs:
            raise ConfigError(
                f"{KEY}.{name}",
                f"easyrl sets this {rollout.name} argument itself: {caps.owned_engine_kwargs[name]}",
            )


def sequences_per_engine_call(cfg: EasyRLConfig) -> int:
    """The most sequences one engine call is given: the prompts in flight at once (`data.rollout_batch_size`; with
    online filtering `data.mini_rollout_batch_size` per try; with `trainer.max_staleness` S >= 1
    `worker.rollout.active_groups`, else (S + 1) x the batch) x `n`, split over the engines (tensor-parallel ranks
    share one: `easyrl.trainer.plan.rollout_engines` counts them the same way)."""
    data, rollout, trainer = cfg.data, cfg.worker.rollout, cfg.trainer
    prompts = data.rollout_batch_size
    if cfg.algorithm.online_filtering and data.mini_rollout_batch_size:
        prompts = data.mini_rollout_batch_size
    if trainer.max_staleness > 0:
        prompts = rollout.active_groups or (trainer.max_staleness + 1) * data.rollout_batch_size
    workers = rollout.n_gpus if rollout.placement == "separate" else trainer.n_gpus_per_node * trainer.nnodes
    engines = max(1, workers // rollout.ranks_per_engine)
    return -(-prompts * rollout.n // engines)
