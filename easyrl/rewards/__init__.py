"""Reward functions: loading a user's ``file.py:function`` and running it isolated in worker processes."""

from easyrl.rewards.loader import REWARD_TYPES, RewardFunction, RewardLoadError, load_reward_function
from easyrl.rewards.manager import RewardError, RewardManager, make_reward_input
from easyrl.rewards.pool import WorkerStartError


__all__ = [
    "REWARD_TYPES",
    "RewardError",
    "RewardFunction",
    "RewardLoadError",
    "RewardManager",
    "WorkerStartError",
    "load_reward_function",
    "make_reward_input",
]
