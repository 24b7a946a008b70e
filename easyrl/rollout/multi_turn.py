"""The multi-turn rollout loop: generate, run the tools the model called, append what they returned, generate again.

Token in, token out. Each trajectory is held as token ids: the prompt, then every completion exactly as sampled,
then each observation's tokens. Its history is never decoded and tokenized again: a text round trip can give
other ids than the sampled ones (a token split differently, a template's whitespace), and the policy would be trained
on sequences it never produced (every peer that re-applied the template per turn saw training drift).

The chat template still decides what the model is shown: after each turn the whole conversation is rendered as text,
and the text the trajectory already holds must be its prefix (the exact-prefix rule, as in prime-rl). Then only the
rest (the end of the assistant turn, the tool messages, the next generation prompt) is tokenized and appended, with
`loss_mask` 0: the observation is attended but neither trained on nor credited. A template that rewrites history
(Qwen3's drops the `<think>` of turns before the last user message) breaks the rule: a new sample starts from the
template's rendering, which is what the model sees from then on.

Departure: the trainer takes one row per trajectory (`B * n` rows, the mini-batches cut by row count), so of a
trajectory split into several samples only the last one, which holds the final answer, is trained on; the earlier
ones are counted (`multi_turn/split_trajectories`, `multi_turn/untrained_tokens`) and a warning says so once. Tool
calls with the Qwen2.5 / Qwen3 / Hermes templates never split: tool messages are not user messages.

This is an episode (`ToolEpisode`, `easyrl.rollout.episode`): after each completion it runs the calls the model made
and says "continue with these observation tokens" or "stop". The synchronous schedule (`MultiTurnLoop`: the carry-over
loop at S = 0) drives it with one engine call per turn for every live trajectory (`EngineSession.generate` inside one
open / close). Turn `t` of trajectory `k` samples with the seed `seeding.call_seed(row seed of k, t)` (turn 0: the row
seed itself, so a one-turn trajectory samples as the single-turn loop does).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from easyrl.agent import (
    AgentRunError,
    Environments,
    Episode,
    Observation,
    ToolCall,
    has_tool_call,
    parse_tool_calls,
    run_tool_calls,
)
from easyrl.agent.resume import call_record, describe, environment_state, rebuild_episode
from easyrl.rollout.carry_over import CarryOverLoop, never_draws
from easyrl.rollout.episode import Continue, Stop
from easyrl.rollout.trajectory import Trajectory


__all__ = [
    "ChatRenderer",
    "MultiTurnLoop",
    "ToolEpisode",
    "ToolSettings",
    "ToolState",
    "TurnBudget",
    "extend_transcript",
]

logger = logging.getLogger(__name__)

STOP_REASONS = ("answer", "env_done", "max_turns", "budget", "length", "env_error")
"""Why a trajectory ended: a turn without a tool call, the environment's `done`, the last turn still calling tools,
the token budget, a turn cut at its token limit, its environment failed (dropped: none of it is trained). `max_turns`,
`budget` and `length` mark the trajectory truncated."""
TRUNCATED = frozenset({"max_turns", "budget", "length"})


class ChatRenderer:
    """The tokenizer and chat template as the loop uses them: conversations rendered to text, new text to ids."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The conversation with the generation prompt, the tools' schemas given to the template."""
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            chat_template=self.chat_template,
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        # the template placed every special token: the tokenizer adds none of its own
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        # special tokens kept: the text must be exactly what the ids are, for the prefix check
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


@dataclass(frozen=True)
class TurnBudget:
    max_turns: int
    max_total_tokens: int
    """Tokens of a trajectory after its first prompt, generated and observed."""
    max_tokens_per_turn: int
    max_prompt_length: int


@dataclass(frozen=True)
class ToolSettings:
    timeout_s: float
    max_output_chars: int
    parallel: int
    max_error_ratio: float = 0.5
    """`worker.rollout.multi_turn.max_env_error_ratio`: past this share of failed trajectories a step stops the run."""


@dataclass
class ToolState:
    """What the tool episode keeps of one trajectory: its environment and conversation, the text its ids spell (the
    prompt's text and every token's text since, which the template's next rendering must extend) and the counts the
    metrics read."""

    episode: Episode
    tools: list[dict[str, Any]]
    prompt_text: str
    text: str = ""
    used: int = 0
    """Tokens after the first prompt, generated and observed (`TurnBudget.max_total_tokens`)."""
    splits: int = 0
    untrained: int = 0
    """Sampled tokens of the samples set aside when the template rewrote the history."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    final_response: str = ""
    pending: list[ToolCall] = field(default_factory=list)
    reward_read: bool = False
    env_reward: float | None = None
    ran: list[dict[str, Any]] = field(default_factory=list)
    """Every tool call run so far and what it returned (`agent.resume.call_record`): a resume replays them."""

    def __post_init__(self) -> None:
        self.text = self.text or self.prompt_text

    def read_reward(self) -> float | None:
        """The environment's `get_reward()`, called once per finished trajectory: the carry-over schedule makes a
        finished group's rows twice (for early scoring, then at the hand-over), and a reward may be costly or have
        side effects (a sandbox, a judge); both rows, and so the score trained on, hold this one result."""
        if not self.reward_read:
            self.env_reward, self.reward_read = self.episode.reward(), True
        return self.env_reward

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (JSON-able): its counts and texts, the conversation, the calls run, and the
        environment's own state where it defines `state_dict` (`easyrl.agent.resume`)."""
        assert not self.pending, "a trajectory is saved between turns, when its calls have run"
        kept = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("episode", "tools", "pending")}
        episode = self.episode
        return copy.deepcopy(kept) | {
            "env_name": episode.env_name,
            "messages": copy.deepcopy(episode.messages),
            "reward_error": episode.reward_error,
            "env_state": environment_state(episode),
        }

    @classmethod
    def restored(cls, episode: Episode, saved: dict[str, Any]) -> ToolState:
        """The state `saved` kept, around `episode` (rebuilt for it: `agent.resume.rebuild_episode`)."""
        kept = copy.deepcopy(saved)
        episode.messages, episode.reward_error = kept.pop("messages"), kept.pop("reward_error")
        del kept["env_name"], kept["env_state"]
        return cls(episode, episode.schemas, **kept)


def extend_transcript(text: str, rendered: str, chat: ChatRenderer) -> Continue:
    """The exact-prefix rule: when `rendered` (the conversation as the template now shows it) extends `text` (what
    the trajectory's ids spell), the rest is the observation (its tokens, appended with loss 0); otherwise a new
    sample starts whose prompt is `rendered`."""
    if rendered.startswith(text):
        return Continue(chat.encode(rendered[len(text) :]))
    return Continue([], prompt=chat.encode(rendered))


class ToolEpisode:
    """The tool-using episode (module docstring): it starts from the environment's messages and, after each
    completion, runs the tool calls in it."""

    def __init__(
        self, environments: Environments, chat: ChatRenderer, budget: TurnBudget, tools: ToolSettings
    ) -> None:
        self.environments = environments
        self.chat = chat
        self.budget = budget
        self.tool_settings = tools
        self._warned_split = False

    def start(self, prompt_ids: list[int], columns: dict[str, Any]) -> Trajectory:
        episode = self.environments.start(columns["row"])
        if episode.error is not None:  # dropped at its first completion (`after`); the dataset's prompt meanwhile
            return Trajectory(prompt_ids, columns, episode_state=ToolState(episode, [], self.chat.decode(prompt_ids)))
        text = self.chat.render(episode.messages, episode.schemas)
        ids = self.chat.encode(text)
        if len(ids) > self.budget.max_prompt_length:
            raise ValueError(
                f"a multi-turn prompt has {len(ids)} tokens (the tools' schemas included) > data.max_prompt_length="
                f"{self.budget.max_prompt_length}: raise data.max_prompt_length (environment {episode.env_name})"
            )
        return Trajectory(ids, columns, episode_state=ToolState(episode, episode.schemas, text))

    def token_limit(self, trajectory: Trajectory) -> int:
        return min(self.budget.max_tokens_per_turn, self.budget.max_total_tokens - _state(trajectory).used)

    def after(self, ended: list[tuple[Trajectory, bool]], stop_ids: frozenset[int]) -> list[Continue | Stop]:
        """Each completion joins the conversation; the tool calls of those that made some run (in parallel), and
        their output is the observation."""
        steps: dict[int, Continue | Stop] = {}
        calling = []
        for k, (traj, stopped) in enumerate(ended):
            state, ids = _state(traj), traj.completion()
            if state.episode.error is not None:  # its environment did not open
                steps[k] = _drop(traj)
                continue
            state.text += self.chat.decode(ids)
            state.used += len(ids)
            content = self.chat.decode(ids[:-1] if stopped and ids and ids[-1] in stop_ids else ids)
            state.episode.messages.append({"role": "assistant", "content": content})
            state.final_response = content
            if not stopped:
                steps[k] = Stop("budget" if state.used >= self.budget.max_total_tokens else "length")
            elif not has_tool_call(content):
                steps[k] = Stop("answer")
            else:
                state.pending = parse_tool_calls(content)
                state.tool_calls += len(state.pending)
                calling.append(k)
        s = self.tool_settings
        work = [(_state(ended[k][0]).episode, _state(ended[k][0]).pending) for k in calling]
        results = run_tool_calls(work, s.timeout_s, s.max_output_chars, s.parallel)
        # `done` may be a property (user code under a deadline): read for every trajectory at once
        dones = self._each([_state(ended[k][0]) for k in calling], lambda st: st.episode.done)
        for k, observations, done in zip(calling, results, dones):
            traj = ended[k][0]
            state = _state(traj)
            state.ran += [call_record(c, o) for c, o in zip(state.pending, observations, strict=True)]
            state.pending = []
            state.tool_errors += sum(o.error for o in observations)
            state.tool_timeouts += sum(o.timed_out for o in observations)
            failed = next((o.content for o in observations if o.failed), None)
            if failed is not None and state.episode.tool_failure is None:
                state.episode.tool_failure = f"{state.episode.owner}: {failed.removeprefix('Error: ')}"
            if state.episode.error is not None:  # reading `done` failed
                steps[k] = _drop(traj)
            elif done:
                steps[k] = Stop("env_done")
            elif traj.turns >= self.budget.max_turns:  # the calls ran (the environment saw them); never read
                steps[k] = Stop("max_turns")
            else:
                steps[k] = self._observe(traj, observations)
        return [steps[k] for k in range(len(ended))]

    def _observe(self, traj: Trajectory, observations: list[Observation]) -> Continue | Stop:
        state = _state(traj)
        state.episode.messages += [o.message() for o in observations]
        rendered = self.chat.render(state.episode.messages, state.tools)
        step = extend_transcript(state.text, rendered, self.chat)
        state.text = rendered  # the text so far and the observation, or the new sample's prompt
        if step.prompt is not None:
            state.prompt_text = rendered
            state.splits += 1
            state.untrained += sum(traj.loss_mask)
            return step
        added = len(step.observation)
        state.observation_tokens += added
        state.used += added
        if state.used >= self.budget.max_total_tokens:  # no room left to answer: cut the observation to the budget
            over = state.used - self.budget.max_total_tokens
            return Stop("budget", step.observation[: added - over])
        return step

    def _each(self, states: list[ToolState], fn: Callable[[ToolState], Any]) -> list[Any]:
        """`fn` of every state, `parallel` at a time: each call into an environment has its own deadline, so many
        hung ones cost one deadline per `parallel` of them, not one each."""
        if len(states) < 2:
            return [fn(st) for st in states]
        with ThreadPoolExecutor(min(self.tool_settings.parallel, len(states)), "easyrl-env") as pool:
            return list(pool.map(fn, states))

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list[Any]]:
        """What the reward function and the logs read: the row with the trajectory's outcome added (its final
        answer, counts, why it stopped, the environment's reward, `env_error` when it was dropped) and the prompt as
        the model saw it."""
        self._each([_state(t) for t in trajectories], ToolState.read_reward)  # read once each, in parallel
        rows = []
        for traj in trajectories:
            state = _state(traj)
            outcome = {
                "final_response": state.final_response,
                "turns": traj.turns,
                "tool_calls": state.tool_calls,
                "tool_errors": state.tool_errors,
                "stop_reason": traj.stop_reason,
                "truncated": traj.stop_reason in TRUNCATED,
                "conversation": state.episode.messages,
                "env_error": state.episode.error,
            }
            reward = state.read_reward()
            if reward is not None:
                outcome["env_reward"] = reward
            rows.append({**traj.columns["row"], **outcome})  # a copy per trajectory: a prompt's samples share one
        return {
            "row": rows,
            "raw_prompt": [_state(t).prompt_text for t in trajectories],
            "stop_reason": [t.stop_reason for t in trajectories],
        }

    def metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        states = [_state(t) for t in trajectories]
        count = len(trajectories)
        calls = sum(s.tool_calls for s in states)
        split = [s for s in states if s.splits]
        untrained = sum(s.untrained for s in split)
        if split and not self._warned_split:
            self._warned_split = True
            logger.warning(
                "the chat template rewrote the history of %d trajectories (the exact-prefix rule started a new sample); "
                "only each one's last sample is trained (%d sampled tokens untrained, multi_turn/untrained_tokens)",
                len(split),
                untrained,
            )
        env_errors = [s.episode.reward_error for s in states if s.episode.reward_error]
        if env_errors:
            logger.warning("get_reward() failed in %d trajectories, e.g. %s", len(env_errors), env_errors[0])
        dropped = sum(s.episode.error is not None for s in states)
        failed = self._check_failures(states)
        truncated = sum(t.stop_reason in TRUNCATED for t in trajectories)
        return {
            "multi_turn/turns_mean": sum(t.turns for t in trajectories) / count,
            "multi_turn/turns_max": float(max(t.turns for t in trajectories)),
            "multi_turn/tool_calls_mean": calls / count,
            "multi_turn/tool_call_rate": sum(s.tool_calls > 0 for s in states) / count,
            "multi_turn/tool_errors": float(sum(s.tool_errors for s in states)),
            "multi_turn/tool_error_rate": sum(s.tool_errors for s in states) / max(calls, 1),
            "multi_turn/tool_timeouts": float(sum(s.tool_timeouts for s in states)),
            "multi_turn/observation_tokens_mean": sum(s.observation_tokens for s in states) / count,
            "multi_turn/truncated": truncated / count,
            "multi_turn/split_trajectories": float(len(split)),
            "multi_turn/untrained_tokens": float(untrained),
            "multi_turn/env_reward_errors": float(len(env_errors)),
            "multi_turn/dropped": float(dropped),
            "multi_turn/failed": failed / count,
        }

    def state_of(self, trajectory: Trajectory) -> dict[str, Any]:
        return _state(trajectory).saved()

    def resume(self, restored: list[tuple[Trajectory, Any]]) -> list[bool]:
        """Each trajectory's environment rebuilt (`easyrl.agent.resume`: its own state loaded, or its calls
        replayed and checked); False for those that cannot be, which one warning names with the fix."""
        ok, failed = [], []
        for traj, saved in restored:
            failure = self._resume(traj, saved)
            ok.append(failure is None)
            failed += [failure] if failure is not None else []
        if failed:
            where = sorted({name for name, _ in failed})
            logger.warning(
                "%d tool trajectories in flight start again from their prompts (rollout/resume_restarts): their "
                "environments could not be rebuilt (environment %s: %s); define state_dict() and "
                "load_state_dict(state) on the environment for an exact resume (docs/agentic.md)",
                len(failed),
                ", ".join(where),
                failed[0][1],
            )
        return ok

    def _resume(self, traj: Trajectory, saved: dict[str, Any] | None) -> tuple[str, str] | None:
        """Give `traj` its tool state back; (environment, why) when it cannot be rebuilt."""
        row = traj.columns["row"]
        if saved is None:
            name = row.get(self.environments.key) if self.environments.key else next(iter(self.environments.types))
            return str(name), "the checkpoint holds no record of them (saved by an earlier easyrl)"
        if traj.done and saved["reward_read"]:  # nothing asks its environment anything again
            episode = Episode(saved["env_name"], None, {}, [], [])
        else:
            s = self.tool_settings
            args = (saved["env_state"], saved["ran"], s.timeout_s, s.max_output_chars)
            episode, reason = rebuild_episode(self.environments, row, *args)
            if reason is not None:
                return describe(episode), reason
        traj.episode_state = ToolState.restored(episode, saved)
        return None

    def _check_failures(self, states: list[ToolState]) -> int:
        """The trajectories that failed in their environment or tools (`_failure`); past `max_error_ratio` of them
        the run stops, with one line naming the first failure."""
        failures = [f for f in map(_failure, states) if f is not None]
        if failures:
            logger.warning(
                "%d of %d trajectories failed in their environment or tools, e.g. %s",
                len(failures),
                len(states),
                failures[0],
            )
        ratio = self.tool_settings.max_error_ratio
        if len(failures) > ratio * len(states):
            raise AgentRunError(
                f"{len(failures)} of {len(states)} trajectories of this step failed in their environment or tools "
                f"(more than worker.rollout.multi_turn.max_env_error_ratio={ratio:g}); the first: {failures[0]}"
            )
        return len(failures)


def _failure(state: ToolState) -> str | None:
    """Why a trajectory failed on the environment's or a tool's side (never the model's): its environment did not
    open or `done` failed (dropped), `get_reward` failed, or a tool timed out or tried to end or fork the process."""
    episode = state.episode
    if episode.reward_error is not None and episode.error is None:
        return f"{episode.owner}: get_reward() failed: {episode.reward_error}"
    return episode.error or episode.tool_failure


def _drop(trajectory: Trajectory) -> Stop:
    """End a trajectory whose environment failed, with nothing of it trained (counted in `multi_turn/dropped`)."""
    trajectory.loss_mask = [0] * len(trajectory.loss_mask)
    return Stop("env_error")


def _state(trajectory: Trajectory) -> ToolState:
    state = trajectory.episode_state
    assert isinstance(state, ToolState), "a trajectory the tool episode did not start"
    return state


class MultiTurnLoop(CarryOverLoop):
    """The synchronous schedule driving the tool episode, what `worker.rollout.multi_turn` turns on: the carry-over
    loop at `max_staleness = 0` (one engine session per batch, one call per turn for the live trajectories; docs/async.md,
    "S = 0"), built from the tool settings alone. The tokenizer's EOS and each call's `stop_token_ids` end a
    completion."""

    def __init__(
        self,
        environments: Environments,
        chat: ChatRenderer,
        budget: TurnBudget,
        tools: ToolSettings,
        engines: int = 1,
    ) -> None:
        episode = ToolEpisode(environments, chat, budget, tools)
        tok = chat.tokenizer
        super().__init__(
            never_draws,
            max_staleness=0,
            active_groups=1,  # at S = 0 a step admits its own prompts, however many
            chunk_tokens=budget.max_total_tokens,  # unread at S = 0: a call asks for the episode's token limit
            max_response_length=budget.max_total_tokens,
            stop_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
            engines=engines,
            episode=episode,
        )
        self.episode: ToolEpisode = episode
        self.environments, self.chat = environments, chat  # what `easyrl check` renders the first prompt with
