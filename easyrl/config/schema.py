"""The root of the configuration: one section per component (each defined beside its component's settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from easyrl.config.algorithm import AlgorithmConfig
from easyrl.config.data import DataConfig
from easyrl.config.sft import SFTConfig
from easyrl.config.trainer import TrainerConfig
from easyrl.config.worker import WorkerConfig


@dataclass
class EasyRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset, prompt formatting and batch sizes."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL, entropy, online filtering and rollout correction."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """Actor, reference, critic, rollout and reward workers."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, resources, logging, validation and checkpoints."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (`easyrl sft`): the conversation columns and length. A config that sets this section
    is an SFT config."""
