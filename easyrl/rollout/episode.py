"""Episodes: what happens to a trajectory after each completion, whatever schedule drives the engine calls.

An `Episode` starts a `Trajectory` from a prompt's columns and, each time a completion ends (a stop token, or the
token limit the episode set for it), says `Continue(observation)` (append these tokens, attended and never trained,
and sample again) or `Stop(reason)`. One schedule drives any episode, `carry_over.CarryOverLoop`: at
`max_staleness = 0` the synchronous one (one engine session per batch, one call per completion), at S >= 1 calls of
`chunk_tokens` across steps. An engine call that ends neither way (cut at the schedule's own chunk, with room left)
is a step with no observation: the schedule continues the trajectory without asking the episode (`after_call`).

Two episodes: `SingleTurnEpisode` (one completion up to `max_response_length`) and the tool-using one
(`multi_turn.ToolEpisode`: the model's tool calls run, their output is the observation; the environment API of
docs/agentic.md is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from easyrl.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class Continue:
    """Sample again after appending `observation` (loss 0). `prompt`: start a new sample from these ids instead (the
    chat template rewrote the history), the tokens so far set aside untrained."""

    observation: list[int]
    prompt: list[int] | None = None


@dataclass(frozen=True)
class Stop:
    reason: str
    """Why it ended (`multi_turn.STOP_REASONS`; a single turn: `stop` or `length`)."""
    observation: list[int] = field(default_factory=list)
    """Tokens appended before it ends (loss 0): an observation cut to the token budget, kept as seen."""


class Episode(Protocol):
    def start(self, prompt_ids: list[int], columns: dict[str, Any]) -> Trajectory:
        """The trajectory of one sample of the prompt with these ids and columns (an episode may render its own)."""
        ...

    def token_limit(self, trajectory: Trajectory) -> int:
        """The most tokens its current completion may reach (counted from the completion's start)."""
        ...

    def after(self, ended: list[tuple[Trajectory, bool]], stop_ids: frozenset[int]) -> list[Continue | Stop]:
        """For each trajectory whose completion just ended (`True`: by a stop token or the engine ending early;
        `False`: at `token_limit`), what comes next (`trajectory.completion()` is what it sampled; `stop_ids` are
        the tokens that end one). Batched, so that the tool calls of several trajectories run in parallel."""
        ...

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list[Any]]:
        """The columns the episode adds to the rows of `trajectories` (what the reward function reads of their
        outcome), one value per trajectory; called for the rows handed over, before `metrics`, and under carry-over
        first for the early scoring of the same finished trajectories: the same values each time (an outcome that
        costs something, an environment's reward, is read once and kept)."""
        ...

    def metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """The episode's figures over `trajectories` (`multi_turn/*`)."""
        ...

    def state_of(self, trajectory: Trajectory) -> Any:
        """What a checkpoint keeps beside the trajectory's record (`Trajectory.state_dict`) of what the episode holds
        of it, JSON-able: None when the record is all of it (a single turn); a tool episode's conversation, the calls
        it ran and its environment's own state."""
        ...

    def resume(self, restored: list[tuple[Trajectory, Any]]) -> list[bool]:
        """Give trajectories restored from their records back what the episode held of them (`state_of`'s value,
        None when the checkpoint has none); False for each it cannot rebuild exactly: the schedule then starts that
        one again from its prompt. Batched, so that one resume warns once."""
        ...


class SingleTurnEpisode:
    """One completion per trajectory, up to `max_response_length` tokens."""

    def __init__(self, max_response_length: int) -> None:
        self.max_len = max_response_length

    def start(self, prompt_ids: list[int], columns: dict[str, Any]) -> Trajectory:
        return Trajectory(prompt_ids, columns)

    def token_limit(self, trajectory: Trajectory) -> int:
        return self.max_len

    def after(self, ended: list[tuple[Trajectory, bool]], stop_ids: frozenset[int]) -> list[Continue | Stop]:
        return [Stop("stop" if stopped else "length") for _, stopped in ended]

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list[Any]]:
        return {}

    def metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        return {}

    def state_of(self, trajectory: Trajectory) -> Any:
        return None

    def resume(self, restored: list[tuple[Trajectory, Any]]) -> list[bool]:
        return [True] * len(restored)


def apply_step(trajectory: Trajectory, step: Continue | Stop) -> None:
    """What an episode said, done to the trajectory: the observation appended (loss 0, stamped with the version of
    the completion it answers), a new sample started, or the trajectory ended."""
    version = trajectory.call_versions[-1] if trajectory.call_versions else -1
    trajectory.append(step.observation, trained=False, log_probs=None, version=version)
    if isinstance(step, Stop):
        trajectory.done, trajectory.stop_reason = True, step.reason
        return
    if step.prompt is not None:
        trajectory.restart(step.prompt)
    trajectory.completion_start = len(trajectory.response_ids)


def after_call(
    trajectory: Trajectory, count: int, max_tokens: int, stopped_by_token: bool, limit: int
) -> tuple[int, bool | None]:
    """How an engine call's `count` tokens (asked for `max_tokens`) end the trajectory's current completion, under the
    episode's `limit` for it: (tokens kept, how it ended) where `True` is a stop (a stop token as the last kept one,
    or fewer tokens than asked), `False` the limit reached, and None neither (a chunk cut by the schedule with room
    left: the completion goes on at the next call, with no observation)."""
    room = limit - (len(trajectory.response_ids) - trajectory.completion_start)
    keep = min(count, room)
    if count > room:  # the call's width is the schedule's: this completion's own limit may be smaller
        return keep, False
    if count < max_tokens or stopped_by_token:
        return keep, True
    return keep, False if keep >= room else None
