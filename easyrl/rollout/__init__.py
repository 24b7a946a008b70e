"""Rollouts: the engines that generate (HF, vLLM), the worker-side object that holds one (`RolloutWorker`), and the
driver-side loops that turn prompts into trainable rows (`RolloutLoop`).

Nothing outside this package names an engine class: a worker builds its engine through `RolloutWorker`, and the
driver sees engines only through the `EngineSession` a loop drives. This package imports nothing of the trainer or
the workers (`tests/test_structure.py`).
"""

from easyrl.rollout.engine import RolloutEngine, SamplingParams
from easyrl.rollout.loop import EngineSession, RolloutLoop, SingleTurnLoop
from easyrl.rollout.spec import RolloutSpec, WeightSync


__all__ = [
    "EngineSession",
    "RolloutEngine",
    "RolloutLoop",
    "RolloutSpec",
    "SamplingParams",
    "SingleTurnLoop",
    "WeightSync",
]
