"""`generate_sequences`, shared by the roles that serve an engine session (the actor's HybridEngine, a rollout worker
of its own): one engine session around one `generate`, in one driver call instead of three."""

from __future__ import annotations

import time
from typing import Any

from easyrl.batch import Batch
from easyrl.distributed import Dispatch, register
from easyrl.rollout.engine import SamplingParams


class OneCallSession:
    """Mixin for a worker with `open_rollout`, `generate` and `close_rollout` (each its own driver call)."""

    open_rollout: Any
    generate: Any
    close_rollout: Any

    @register(dispatch=Dispatch.ENGINE_SPLIT)
    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """Open, generate, close (the driver's synchronous loop, one round trip). Returns the rows and the session's
        timings (`timing_s/generate_engine`, and the role's own: `/wake`, `/update_weights`, `/sleep`)."""
        timing: dict[str, float] = self.open_rollout()
        start = time.perf_counter()
        out = self.generate(prompts, params)
        timing["timing_s/generate_engine"] = time.perf_counter() - start
        return out, timing | self.close_rollout()
