"""Typed configuration: dataclass defaults <- YAML file <- command-line `key=value` overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

from easyrl.config.algorithm import AlgorithmConfig
from easyrl.config.data import DataConfig
from easyrl.config.trainer import TrainerConfig
from easyrl.config.worker import (
    ActorConfig,
    CriticConfig,
    FSDPConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    WorkerConfig,
)


@dataclass
class EasyRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset, prompt formatting and batch sizes."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL, entropy and online filtering."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """Actor, reference, critic, rollout and reward workers."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, resources, logging, validation and checkpoints."""


from easyrl.config.loader import ConfigError, load_config, load_config_and_secrets, to_masked_dict  # noqa: E402
from easyrl.config.secrets import Secrets  # noqa: E402


__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EasyRLConfig",
    "FSDPConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "Secrets",
    "TrainerConfig",
    "WorkerConfig",
    "load_config",
    "load_config_and_secrets",
    "to_masked_dict",
]
