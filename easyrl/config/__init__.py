"""Typed configuration: dataclass defaults <- YAML file <- command-line `key=value` overrides."""

from __future__ import annotations

from easyrl.config.algorithm import AlgorithmConfig, DistillConfig, RolloutCorrectionConfig
from easyrl.config.data import DataConfig
from easyrl.config.errors import ConfigError
from easyrl.config.loader import load_config, load_config_and_secrets, to_masked_dict
from easyrl.config.model_ref import ModelRefConfig
from easyrl.config.schema import EasyRLConfig
from easyrl.config.secrets import Secrets
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


__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "EasyRLConfig",
    "FSDPConfig",
    "ModelConfig",
    "ModelRefConfig",
    "OffloadConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "Secrets",
    "TrainerConfig",
    "WorkerConfig",
    "load_config",
    "load_config_and_secrets",
    "to_masked_dict",
]
