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

One engine call per turn serves every live trajectory (`EngineSession.generate` inside one open / close). Turn `t`
of trajectory `k` samples with the seed `derive_seed(row seed of k, t, "attempt")` (turn 0: the row seed itself, so
a one-turn trajectory samples as the single-turn loop does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from easyrl.agent import Environments, Episode, Observation, ToolCall, has_tool_call, parse_tool_calls, run_tool_calls
from easyrl.batch import Batch
from easyrl.rollout.engine import SamplingParams
from easyrl.rollout.loop import EngineSession, OneSessionLoop
from easyrl.rollout.trajectory import Trajectory, request_of, rows_of
from easyrl.seeding import derive_seed, prompt_seeds


__all__ = ["ChatRenderer", "MultiTurnLoop", "ToolSettings", "Transcript", "TurnBudget", "extend_transcript"]

logger = logging.getLogger(__name__)

STOP_REASONS = ("answer", "env_done", "max_turns", "budget", "length")
"""Why a trajectory ended: a turn without a tool call, the environment's `done`, the last turn still calling tools,
the token budget, a turn cut at its token limit. All but the first two mark the trajectory truncated."""
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


@dataclass
class Transcript:
    """A trajectory as the chat template sees it: its record (`Trajectory`) and the text its ids spell (the prompt's
    text and the text of every token appended since), which the template's next rendering must extend."""

    record: Trajectory
    prompt_text: str
    text: str = ""

    def __post_init__(self) -> None:
        self.text = self.text or self.prompt_text

    def append_completion(self, ids: list[int], text: str, log_probs: list[float], version: int) -> None:
        self.record.append(ids, trained=True, log_probs=log_probs, version=version)
        self.text += text


def extend_transcript(transcript: Transcript, rendered: str, chat: ChatRenderer) -> tuple[Transcript, int]:
    """The exact-prefix rule: when `rendered` (the conversation as the template now shows it) extends the transcript's
    text, append the rest as observation tokens (loss 0) and return (the transcript, tokens added); otherwise start a
    new one whose prompt is `rendered` (its calls' counts carried on) and return (it, 0)."""
    record = transcript.record
    version = record.call_versions[-1] if record.call_versions else -1  # the completion the observation answers
    if rendered.startswith(transcript.text):
        rest = rendered[len(transcript.text) :]
        ids = chat.encode(rest)
        record.append(ids, trained=False, log_probs=None, version=version)
        transcript.text += rest
        return transcript, len(ids)
    fresh = Trajectory(
        chat.encode(rendered),
        record.columns,
        call_versions=list(record.call_versions),
        logprob_rows=list(record.logprob_rows),
        sessions=record.sessions,
        last_session=record.last_session,
    )
    return Transcript(fresh, rendered), 0


@dataclass
class ToolRollout:
    """One rollout: its episode (environment and tools), the transcript being built and the counts the metrics
    read."""

    episode: Episode
    seed: int
    transcript: Transcript
    tools: list[dict[str, Any]]
    earlier: list[Transcript] = field(default_factory=list)
    used: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    final_response: str = ""
    stop_reason: str | None = None
    pending: list[ToolCall] = field(default_factory=list)

    def context(self) -> list[int]:
        return self.transcript.record.context()


class MultiTurnLoop(OneSessionLoop):
    """A `RolloutLoop` of several turns with tools or an environment between them (module docstring)."""

    def __init__(
        self,
        environments: Environments,
        chat: ChatRenderer,
        budget: TurnBudget,
        tools: ToolSettings,
        engines: int = 1,
    ) -> None:
        self.environments = environments
        self.chat = chat
        self.budget = budget
        self.tool_settings = tools
        self.engines = engines  # the request of each turn is padded to split evenly over them
        self.pad_id = chat.tokenizer.pad_token_id
        self.sessions = 0  # engine sessions opened: each run is one
        self._warned_split = False

    # ------------------------------------------------------------------ the loop
    def run(self, engines: EngineSession, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        if params.seed is None:
            raise ValueError("a rollout loop needs params.seed: the trainer derives one per call (easyrl.seeding)")
        if any(prompts.non_tensors.get("multi_modal_inputs") or []):
            raise ValueError("multi-turn rollouts take text prompts only: this batch carries images, videos or audio")
        firsts = prompt_seeds(params.seed, len(prompts), params.n).tolist()
        columns = [{k: v[i] for k, v in prompts.non_tensors.items()} for i in range(len(prompts))]
        trajectories = [
            self._start(columns[i // params.n], firsts[i // params.n] + i % params.n)
            for i in range(len(prompts) * params.n)
        ]
        stop_ids = {self.chat.tokenizer.eos_token_id, *params.stop_token_ids}
        timings = engines.open_rollout()
        self.sessions += 1
        gen_s = tool_s = 0.0
        try:
            for turn in range(self.budget.max_turns):
                live = [t for t in trajectories if t.stop_reason is None]
                if not live:
                    break
                start = time.perf_counter()
                self._generate(engines, live, turn, params, stop_ids)
                gen_s += time.perf_counter() - start
                start = time.perf_counter()
                self._run_tools([t for t in live if t.pending], last_turn=turn + 1 == self.budget.max_turns)
                tool_s += time.perf_counter() - start
        finally:
            timings |= engines.close_rollout()
        batch = rows_of([t.transcript.record for t in trajectories], self.pad_id)
        if not params.logprobs:  # the engines fill zeros where none were asked for: nothing to compare against
            batch.tensors.pop("rollout_log_probs")
        batch.set(**self._driver_columns(batch, trajectories))
        timings |= {"timing_s/generate_turns": gen_s, "timing_s/tools": tool_s}
        return batch, timings | self._metrics(trajectories)

    def _start(self, columns: dict[str, Any], seed: int) -> ToolRollout:
        episode = self.environments.start(columns["row"])
        text = self.chat.render(episode.messages, episode.schemas)
        ids = self.chat.encode(text)
        if len(ids) > self.budget.max_prompt_length:
            raise ValueError(
                f"a multi-turn prompt has {len(ids)} tokens (the tools' schemas included) > data.max_prompt_length="
                f"{self.budget.max_prompt_length}: raise data.max_prompt_length (environment {episode.env_name})"
            )
        return ToolRollout(episode, seed, Transcript(Trajectory(ids, columns), text), episode.schemas)

    def _generate(
        self, engines: EngineSession, live: list[ToolRollout], turn: int, params: SamplingParams, stop_ids: set[int]
    ) -> None:
        """One engine call for every live trajectory; appends each completion (loss 1) and decides what comes next."""
        limits = [min(self.budget.max_tokens_per_turn, self.budget.max_total_tokens - t.used) for t in live]
        max_tokens = max(limits)
        seeds = [t.seed if turn == 0 else derive_seed(t.seed, turn, "attempt") for t in live]
        request = request_of([t.context() for t in live], seeds, self.pad_id, self.engines)
        out = engines.generate(request, params.override({"n": 1, "max_tokens": max_tokens}))
        lengths = out["response_mask"].sum(dim=1).tolist()
        for i, (traj, limit) in enumerate(zip(live, limits)):
            n = int(lengths[i])
            ids = out["responses"][i, :n].tolist()
            cut = n > limit  # the call's width is the widest budget's: this trajectory's own may be smaller
            ids = ids[:limit]
            stopped = not cut and (n < max_tokens or (n > 0 and ids[-1] in stop_ids))
            version = int(out["policy_version"][i])
            lps = out["rollout_log_probs"][i, : len(ids)].tolist()
            traj.transcript.append_completion(ids, self.chat.decode(ids), lps, version)
            has_logprobs = bool(out["rollout_logprob_mask"][i]) if "rollout_logprob_mask" in out else None
            traj.transcript.record.record_call(self.sessions, version, has_logprobs)
            traj.used += len(ids)
            traj.turns += 1
            content = self.chat.decode(ids[:-1] if stopped and ids and ids[-1] in stop_ids else ids)
            traj.episode.messages.append({"role": "assistant", "content": content})
            traj.final_response = content
            if not stopped:
                traj.stop_reason = "budget" if traj.used >= self.budget.max_total_tokens else "length"
            elif not has_tool_call(content):
                traj.stop_reason = "answer"
            else:
                traj.pending = parse_tool_calls(content)
                traj.tool_calls += len(traj.pending)

    def _run_tools(self, calling: list[ToolRollout], last_turn: bool) -> None:
        """Run the calls of this turn; unless the trajectory ends here, append the observations (loss 0)."""
        s = self.tool_settings
        results = run_tool_calls(
            [(t.episode, t.pending) for t in calling], s.timeout_s, s.max_output_chars, s.parallel
        )
        for traj, observations in zip(calling, results):
            traj.pending = []
            traj.tool_errors += sum(o.error for o in observations)
            traj.tool_timeouts += sum(o.timed_out for o in observations)
            if traj.episode.done:
                traj.stop_reason = "env_done"
            elif last_turn:  # the calls ran (the environment saw them); their output is never read
                traj.stop_reason = "max_turns"
            else:
                self._observe(traj, observations)

    def _observe(self, traj: ToolRollout, observations: list[Observation]) -> None:
        traj.episode.messages += [o.message() for o in observations]
        rendered = self.chat.render(traj.episode.messages, traj.tools)
        transcript, added = extend_transcript(traj.transcript, rendered, self.chat)
        if transcript is not traj.transcript:
            traj.earlier.append(traj.transcript)
            traj.transcript = transcript
            return
        traj.observation_tokens += added
        traj.used += added
        if traj.used >= self.budget.max_total_tokens:  # no room left to answer: cut the observation to the budget
            over = traj.used - self.budget.max_total_tokens
            if over:
                transcript.record.truncate(len(transcript.record.response_ids) - over)
            traj.stop_reason = "budget"

    # ------------------------------------------------------------------ rows
    def _driver_columns(self, batch: Batch, trajectories: list[ToolRollout]) -> dict[str, list[Any]]:
        """What the reward function and the logs read: the row with the trajectory's outcome added (its final
        answer, counts, why it stopped, the environment's reward) and the prompt as the model saw it."""
        rows = []
        for row, traj in zip(batch["row"], trajectories):
            outcome = {
                "final_response": traj.final_response,
                "turns": traj.turns,
                "tool_calls": traj.tool_calls,
                "tool_errors": traj.tool_errors,
                "stop_reason": traj.stop_reason,
                "truncated": traj.stop_reason in TRUNCATED,
                "conversation": traj.episode.messages,
            }
            reward = traj.episode.reward()
            if reward is not None:
                outcome["env_reward"] = reward
            rows.append({**row, **outcome})  # a copy per trajectory: the n samples of a prompt shared one dict
        return {
            "row": rows,
            "raw_prompt": [t.transcript.prompt_text for t in trajectories],
            "stop_reason": [t.stop_reason for t in trajectories],
        }

    def _metrics(self, trajectories: list[ToolRollout]) -> dict[str, float]:
        count = len(trajectories)
        calls = sum(t.tool_calls for t in trajectories)
        split = [t for t in trajectories if t.earlier]
        untrained = sum(sum(s.record.loss_mask) for t in split for s in t.earlier)
        if split and not self._warned_split:
            self._warned_split = True
            logger.warning(
                "the chat template rewrote the history of %d trajectories (the exact-prefix rule started a new sample); "
                "only each one's last sample is trained (%d sampled tokens untrained, multi_turn/untrained_tokens)",
                len(split),
                untrained,
            )
        env_errors = [t.episode.reward_error for t in trajectories if t.episode.reward_error]
        if env_errors:
            logger.warning("get_reward() failed in %d trajectories, e.g. %s", len(env_errors), env_errors[0])
        return {
            "multi_turn/turns_mean": sum(t.turns for t in trajectories) / count,
            "multi_turn/turns_max": float(max(t.turns for t in trajectories)),
            "multi_turn/tool_calls_mean": calls / count,
            "multi_turn/tool_call_rate": sum(t.tool_calls > 0 for t in trajectories) / count,
            "multi_turn/tool_errors": float(sum(t.tool_errors for t in trajectories)),
            "multi_turn/tool_error_rate": sum(t.tool_errors for t in trajectories) / max(calls, 1),
            "multi_turn/tool_timeouts": float(sum(t.tool_timeouts for t in trajectories)),
            "multi_turn/observation_tokens_mean": sum(t.observation_tokens for t in trajectories) / count,
            "multi_turn/truncated": sum(t.stop_reason in TRUNCATED for t in trajectories) / count,
            "multi_turn/split_trajectories": float(len(split)),
            "multi_turn/untrained_tokens": float(untrained),
            "multi_turn/env_reward_errors": float(len(env_errors)),
        }
