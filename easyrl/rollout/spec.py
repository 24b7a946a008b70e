"""What a rollout engine is given: one frozen spec, built on the driver (`easyrl.trainer.role_specs`), and how the
policy's weights reach it (`WeightSync`). Pure data: importing this module imports no engine and no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from easyrl.config.worker import ModelConfig, RolloutConfig


class WeightSync(str, enum.Enum):
    """How the policy's weights reach the rollout engine at each push (resolved on the driver from the LoRA
    settings, `easyrl.trainer.plan.weight_sync`): the actor reads this choice, never the LoRA config."""

    FULL = "full"
    """Every weight of the (non-LoRA) policy, streamed in memory (`engine.load_weights`)."""
    MERGED_LORA = "merged_lora"
    """A LoRA policy's merged weights (base + scale * B @ A) under the base's names (`engine.load_weights`)."""
    ADAPTER = "adapter"
    """Only the LoRA adapters (`engine.load_adapter`): the engine keeps its base weights across steps."""

    @classmethod
    def resolve(cls, lora_rank: int, rollout_sync: str) -> WeightSync:
        """The choice for `worker.actor.model.lora.rank` / `.rollout_sync` (validated: `merged` or `adapter`)."""
        if lora_rank <= 0:
            return cls.FULL
        return cls.ADAPTER if rollout_sync == "adapter" else cls.MERGED_LORA

    @property
    def sleep_level(self) -> int:
        """vLLM's sleep level when `worker.rollout.sleep_level` is null: 1 keeps the base weights (in host memory)
        for adapter sync; 2 drops them, since every push after a wake sends all of them anyway (a level-1 copy to
        host and back would be thrown away)."""
        return 1 if self is WeightSync.ADAPTER else 2


@dataclass(frozen=True)
class RolloutSpec:
    """The rollout engine of the actor's process."""

    config: RolloutConfig
    """`worker.rollout`: engine kind, dtype, memory, sleep mode, tensor parallelism."""
    model: ModelConfig
    """The policy's model (the engine loads the same checkpoint)."""
    max_model_len: int
    """Prompt + response tokens the engine must hold (`max_model_len`, else the data's lengths)."""
    logprob_ratio: float
    """Share of requests that get the engine's per-token log-probs (resolved from `logprob_sample_ratio`)."""
    weight_sync: WeightSync
    """How each push sends the policy's weights to the engine."""
    sleep_level: int
    """vLLM's sleep level: `worker.rollout.sleep_level`, else `weight_sync.sleep_level`."""
    sequences_per_call: int = 0
    """The most sequences one engine call is given (`easyrl.rollout.vllm_args.sequences_per_engine_call`; 0:
    unknown): what the engine's CUDA-graph capture must cover."""
