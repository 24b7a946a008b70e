"""Errors that end a run with a one-line message instead of a traceback."""

from __future__ import annotations


def is_user_facing(exc: BaseException) -> bool:
    """Errors whose message already names the culprit and the fix."""
    from easyrl.agent import AgentLoadError, AgentRunError
    from easyrl.checkpoint import CheckpointError
    from easyrl.data.loading import DataError
    from easyrl.distributed.errors import ResourceUnavailableError, WorkerGroupError
    from easyrl.trainer.run import StopRequested, TrainingError

    user_facing: tuple[type[BaseException], ...] = (
        DataError,
        WorkerGroupError,
        ResourceUnavailableError,
        TrainingError,
        CheckpointError,
        StopRequested,
        AgentLoadError,  # an environment or tool file that cannot be used, named with the fix
        AgentRunError,  # too many trajectories failed in their environment or tools, the first failure named
    )
    try:
        from easyrl.rewards import RewardError, RewardLoadError

        user_facing += (RewardError, RewardLoadError)
    except ImportError:
        pass
    return isinstance(exc, user_facing)
