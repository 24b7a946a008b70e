"""The one token record of a rollout and the two conversions every loop shares: trajectories to an engine request
(`request_of`), trajectories to the batch's rows (`rows_of`).

A `Trajectory` is one response being built, as token ids: its prompt, then everything after it (the completions
exactly as the engines sampled them, each with its behaviour log-prob and the policy version that sampled it, and any
observation an episode appended, with `loss_mask` 0). The carry-over loop keeps them across steps (a partial rollout
is a trajectory whose last call was cut at `chunk_tokens`), the multi-turn loop appends tool output to them; both hand
the trainer the rows `rows_of` makes, which follow the row contract of `easyrl.rollout.loop` (`RolloutEngine.generate`'s
fields, the prompts' own columns and `policy_version`, plus `token_policy_version` and `rollout_sessions`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from easyrl.batch import Batch
from easyrl.seeding import SEED_COLUMN


@dataclass
class Trajectory:
    """One response in progress. `columns` are its prompt's non-tensor columns (the row, answers, texts, media and
    the engine's columns), shared with the other samples of the prompt and carried into its row as they are."""

    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: sampled ones and observations."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on the tokens the engines sampled (trained on), 0 on observations (attended only)."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each sampled token (0 on observations)."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (an observation: that of the completion before it)."""
    call_versions: list[int] = field(default_factory=list)
    """The policy version of each engine call it took part in: the row's `policy_version` is the oldest."""
    logprob_rows: list[bool] = field(default_factory=list)
    """Per call, whether the engine gave log-probs for it (an engine may sample them for some rows only)."""
    turns: int = 0
    """Completions that ended (a stop token or a turn's token limit); a carry-over chunk cut short is not one."""
    sessions: int = 0
    """Engine sessions it was generated in: 2 or more is a partial rollout resumed with newer weights."""
    last_session: int = -1
    done: bool = False
    stop_reason: str | None = None
    completion_start: int = 0
    """Where the completion being sampled starts in `response_ids` (after the last observation): a completion may
    take several engine calls (carry-over chunks)."""
    episode_state: Any = field(default=None, repr=False)
    """What its episode keeps of it (a tool episode: the environment, the conversation); not part of `state_dict`."""

    def context(self) -> list[int]:
        """What the next engine call continues: the prompt and every token so far."""
        return self.prompt_ids + self.response_ids

    def append(self, ids: list[int], trained: bool, log_probs: list[float] | None, version: int) -> None:
        """Append sampled tokens (`trained`, with their log-probs) or an observation's (loss 0, log-prob 0)."""
        self.response_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def completion(self) -> list[int]:
        """The tokens of the completion being sampled (or just ended)."""
        return self.response_ids[self.completion_start :]

    def restart(self, prompt_ids: list[int]) -> None:
        """A new sample from `prompt_ids` (the chat template rewrote the history): the tokens so far are dropped
        (untrained); the calls' counts and versions carry on."""
        self.prompt_ids = prompt_ids
        self.response_ids, self.loss_mask, self.log_probs, self.versions = [], [], [], []

    def record_call(self, session: int, version: int, has_logprobs: bool | None) -> None:
        """Count an engine call of engine session `session`, made with policy `version`."""
        self.call_versions.append(version)
        if has_logprobs is not None:
            self.logprob_rows.append(has_logprobs)
        if self.last_session != session:
            self.sessions, self.last_session = self.sessions + 1, session

    def state_dict(self) -> dict[str, Any]:
        """Its tokens and counts, JSON-able, without the prompt (its group holds it once for all its samples)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("prompt_ids", "columns", "episode_state")}

    @classmethod
    def from_state(cls, state: dict[str, Any], prompt_ids: list[int], columns: dict[str, Any]) -> Trajectory:
        """The trajectory of `state` (`state_dict`) on its group's prompt, or on its own where the record holds one
        (a sample the chat template restarted); an episode's state kept beside it is its episode's to restore."""
        state = {k: v for k, v in state.items() if k != "episode_state"}
        prompt_ids = state.pop("prompt_ids", prompt_ids)
        if "tokens" in state:  # a checkpoint from before the one record: every token sampled, none observed
            tokens = state.pop("tokens")
            state |= {"response_ids": tokens, "loss_mask": [1] * len(tokens)}
            state.setdefault("call_versions", [min(state["versions"])] if state["versions"] else [])
        return cls(prompt_ids, columns, **state)


def append_call(trajectory: Trajectory, out: Batch, row: int, keep: int, session: int, per_row_logprobs: bool) -> None:
    """Append the first `keep` tokens of row `row` of an engine call's output `out` to `trajectory` (sampled: trained,
    with the engine's log-probs and the call's policy version) and count the call, made in engine session `session`.
    `per_row_logprobs`: keep the engine's word on whether this row has log-probs (`rollout_logprob_mask`)."""
    version = int(out["policy_version"][row])
    ids = out["responses"][row, :keep].tolist()
    trajectory.append(ids, trained=True, log_probs=out["rollout_log_probs"][row, :keep].tolist(), version=version)
    told = per_row_logprobs and "rollout_logprob_mask" in out
    trajectory.record_call(session, version, bool(out["rollout_logprob_mask"][row]) if told else None)


def left_padded(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """`rows` of token ids left-padded to the longest: `input_ids`, `attention_mask`, `position_ids` (N, W)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def request_of(
    contexts: list[list[int]],
    seeds: list[int],
    pad_id: int,
    engines: int,
    columns: dict[str, list[Any]] | None = None,
) -> Batch:
    """An engine call: `contexts` left-padded with each one's seed (`sample_seed`) and any per-row `columns` (the
    media: `media_columns`), the last row repeated until the call splits evenly over `engines` (its extra rows'
    output is never read)."""
    extra = (-len(contexts)) % engines
    request = Batch(left_padded(contexts + [contexts[-1]] * extra, pad_id))
    request.set(**{k: list(v) + [v[-1]] * extra for k, v in (columns or {}).items()})
    return request.set(**{SEED_COLUMN: torch.tensor(seeds + [seeds[-1]] * extra, dtype=torch.int64)})


def media_columns(trajectories: list[Trajectory]) -> dict[str, list[Any]]:
    """The engine columns (`loop.ENGINE_COLUMNS`) of a call continuing `trajectories` from their `context()`; `{}`
    when none carries media. `multi_modal_inputs` (the processed pixels and grids: the HF engine) is the prompt's
    own, so the model computes the same 3D rope positions for the prompt, and the text after it continues them as
    they continued during the first call. `rollout_prompt` (an engine that expands the media itself: vLLM) is the
    prompt's unexpanded ids followed by the tokens so far, with the same media: expanded, it is the context."""
    if not any(t.columns.get("multi_modal_inputs") or t.columns.get("rollout_prompt") for t in trajectories):
        return {}
    out: dict[str, list[Any]] = {"multi_modal_inputs": [], "rollout_prompt": []}
    for t in trajectories:
        out["multi_modal_inputs"].append(t.columns.get("multi_modal_inputs"))
        prompt = t.columns.get("rollout_prompt") or {}
        if prompt.get("multi_modal_data"):
            prompt = {**prompt, "prompt_token_ids": list(prompt["prompt_token_ids"]) + t.response_ids}
        out["rollout_prompt"].append(prompt)
    return out


def _right_padded(values: list[list[Any]], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(values), width), fill, dtype=dtype)
    for i, row in enumerate(values):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def rows_of(trajectories: list[Trajectory], pad_id: int, width: int | None = None) -> Batch:
    """The rows of `trajectories`, one each in order: the engine's fields (`prompts` left-padded, `responses`
    right-padded to `width` or the longest, `response_mask` over every response token, `loss_mask` over the sampled
    ones, the whole sequence's `input_ids` / `attention_mask` / `position_ids`, `rollout_log_probs`), the oldest
    `policy_version` of each row's calls, each token's `token_policy_version` (-1 past the response), the engine
    sessions it took (`rollout_sessions`), `rollout_logprob_mask` when the engine said which rows have log-probs, and
    every prompt column."""
    prompt = left_padded([t.prompt_ids for t in trajectories], pad_id)
    width = width if width is not None else max(1, max(len(t.response_ids) for t in trajectories))
    responses = _right_padded([t.response_ids for t in trajectories], width, pad_id, torch.long)
    response_mask = _right_padded([[1] * len(t.response_ids) for t in trajectories], width, 0, torch.long)
    attention_mask = torch.cat([prompt["attention_mask"], response_mask], dim=1)
    tensors = {
        **prompt,  # the prompts' own tensors first, as a loop's prompts batch has them (the row's fields replace them)
        "prompts": prompt["input_ids"],
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": _right_padded([t.loss_mask for t in trajectories], width, 0, torch.long),
        "input_ids": torch.cat([prompt["input_ids"], responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "rollout_log_probs": _right_padded([t.log_probs for t in trajectories], width, 0.0, torch.float32),
        "policy_version": torch.tensor([min(t.call_versions) for t in trajectories], dtype=torch.int64),
        "token_policy_version": _right_padded([t.versions for t in trajectories], width, -1, torch.int64),
        "rollout_sessions": torch.tensor([t.sessions for t in trajectories], dtype=torch.int64),
    }
    if all(t.logprob_rows for t in trajectories):  # the engine told, per call, which rows it sampled log-probs for
        tensors["rollout_logprob_mask"] = torch.tensor([all(t.logprob_rows) for t in trajectories])
    keys = dict.fromkeys(k for t in trajectories for k in t.columns)
    return Batch(tensors, {k: [t.columns[k] for t in trajectories] for k in keys})


def columns_state(columns: dict[str, Any]) -> dict[str, Any]:
    """A prompt's columns made JSON-able for a checkpoint of work in flight: its media (`multi_modal_inputs`' tensors,
    `rollout_prompt`'s pixel arrays) as tagged base64 bytes, which `columns_from_state` turns back into equal tensors
    and arrays. The processed pixels are kept rather than re-read from the data set, so a resumed response continues
    from the very inputs it started with; the cost is the media of the groups in flight, in the checkpoint."""
    return {k: _to_json(v) for k, v in columns.items()}


def columns_from_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: _from_json(v) for k, v in state.items()}


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()  # bf16 too: no numpy dtype
        dtype = str(value.dtype).removeprefix("torch.")
        return {"__tensor__": dtype, "shape": list(value.shape), "data": base64.b64encode(raw).decode("ascii")}
    if isinstance(value, np.ndarray):
        raw = np.ascontiguousarray(value).tobytes()
        return {"__ndarray__": str(value.dtype), "shape": list(value.shape), "data": base64.b64encode(raw).decode()}
    if isinstance(value, np.generic):  # numpy scalars (a video's frame indices)
        return value.item()
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a video is a (frames, metadata) pair: a list once restored (unpacks alike)
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        data = bytearray(base64.b64decode(value["data"]))  # writable: frombuffer shares it
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        return flat.view(getattr(torch, value["__tensor__"])).reshape(value["shape"])
    if isinstance(value, dict) and "__ndarray__" in value:
        raw = base64.b64decode(value["data"])
        return np.frombuffer(raw, dtype=value["__ndarray__"]).reshape(value["shape"]).copy()
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value
