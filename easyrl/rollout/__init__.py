"""Rollouts: the engines that generate (HF, vLLM), the worker-side object that holds one (`RolloutWorker`), and the
driver-side loops that turn prompts into trainable rows (`RolloutLoop`).

Nothing outside this package names an engine class or compares `worker.rollout.name` with an engine's name:
`worker.rollout.name` picks a registered engine (`register_engine`, with the `EngineCapabilities` everything else
reads), a worker builds it through `RolloutWorker`, and the driver sees engines only through the
`EngineSession` a loop drives. This package imports nothing of the trainer or
the workers (`tests/test_structure.py`).
"""

from easyrl.config.engines import EngineCapabilities
from easyrl.rollout.engine import EngineCheck, RolloutEngine, SamplingParams
from easyrl.rollout.loop import EngineSession, RolloutLoop, SingleTurnLoop
from easyrl.rollout.registry import EngineContext, register_engine
from easyrl.rollout.spec import RolloutSpec, WeightSync


__all__ = [
    "EngineCapabilities",
    "EngineCheck",
    "EngineContext",
    "EngineSession",
    "RolloutEngine",
    "RolloutLoop",
    "RolloutSpec",
    "SamplingParams",
    "SingleTurnLoop",
    "WeightSync",
    "register_engine",
]
