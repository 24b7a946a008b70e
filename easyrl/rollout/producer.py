"""The one place that picks how prompts become rows from the config: the schedule (one engine session per call, or
carry-over with `trainer.max_staleness` >= 1) and the episode (one completion, or turns with tools between them).
The trainer gets a `RolloutLoop` from here and drives it through that protocol alone (`tests/test_structure.py`:
nothing under `trainer/` names a concrete loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout.loop import RolloutLoop, Scorer, SingleTurnLoop


def build_rollout_loop(
    cfg: EasyRLConfig,
    *,
    draw: Callable[[int], Batch] | None,
    eos_id: int | None,
    pad_id: int,
    scorer: Scorer | None,
    engines: int,
    chunk_tokens: int,
    staleness: int,
    tools: bool,
    beside: bool,
) -> RolloutLoop:
    """One engine session per batch and one response per sample (`SingleTurnLoop`); several turns with tools between
    them when `worker.rollout.multi_turn` sets an environment or tools (`MultiTurnLoop`); or, with
    `trainer.max_staleness` >= 1, groups kept in flight across steps (`CarryOverLoop`, driving the tool episode when
    `multi_turn` is on, else the single-turn one: it draws prompts of its own
    with `draw`, ends responses at `eos_id` and `worker.rollout.stop_token_ids` as the engines do, scores each call's
    finished groups with `scorer` beside the engines, and generates beside the training when the engines are
    separate). The schedule and episode come decided (the trainer's run plan, `easyrl.trainer.plan`), not re-read:
    `engines`, how many engines a call is split over; `chunk_tokens`, the carry-over call's length; `staleness`, the
    bound (0: synchronous); `tools`, the tool episode; `beside`, engines of their own that generate while the policy
    trains."""
    rollout = cfg.worker.rollout
    if staleness == 0:
        return multi_turn_loop(cfg, engines) if tools else SingleTurnLoop()
    from easyrl.rollout.carry_over import CarryOverLoop
    from easyrl.rollout.multi_turn import ToolEpisode

    assert draw is not None, "an asynchronous loop draws prompts of its own"
    per_step = cfg.data.rollout_batch_size
    stop_ids = [] if rollout.ignore_eos else [*([eos_id] if eos_id is not None else []), *rollout.stop_token_ids]
    return CarryOverLoop(
        draw,
        max_staleness=staleness,
        active_groups=rollout.active_groups or (staleness + 1) * per_step,
        chunk_tokens=chunk_tokens,
        max_response_length=cfg.data.max_response_length,
        stop_ids=stop_ids,
        pad_id=pad_id,
        engines=engines,
        scorer=scorer,
        beside=beside,
        episode=ToolEpisode(*tool_parts(cfg)) if tools else None,
    )


def one_session_loop(
    cfg: EasyRLConfig, loop: RolloutLoop, engines: int, *, staleness: int, tools: bool
) -> RolloutLoop:
    """The loop for validation and ReMax's greedy baselines, which take one engine session per call and keep nothing
    in flight: with tools, the synchronous multi-turn loop (the run's own when it is synchronous: the tools are part
    of what is measured), else the single-turn one (a carry-over loop's groups in flight are training work, never
    validation's)."""
    if not tools:
        return SingleTurnLoop()
    return loop if staleness == 0 else multi_turn_loop(cfg, engines)


def multi_turn_loop(cfg: EasyRLConfig, engines: int) -> RolloutLoop:
    """The synchronous multi-turn loop of `worker.rollout.multi_turn` (`tool_parts`)."""
    from easyrl.rollout.multi_turn import MultiTurnLoop

    return MultiTurnLoop(*tool_parts(cfg), engines)


def tool_parts(cfg: EasyRLConfig) -> tuple[Any, Any, Any, Any]:
    """What the tool episode of `worker.rollout.multi_turn` is made of: its environments and tools imported (a tool
    without type hints or docstring stops the run here, before any worker starts), the policy's tokenizer and chat
    template, the turn budget and the tool settings."""
    from easyrl.agent import load_environments
    from easyrl.data.prompts import PromptRenderer, load_chat_template
    from easyrl.models import load_tokenizer
    from easyrl.rollout.multi_turn import ChatRenderer, ToolSettings, TurnBudget

    mt, model = cfg.worker.rollout.multi_turn, cfg.worker.actor.model
    assert model.tokenizer_path is not None
    tokenizer, _ = load_tokenizer(model.tokenizer_path, trust_remote_code=model.trust_remote_code)
    chat_template = load_chat_template(cfg.data.override_chat_template)
    # without an environment a trajectory opens with the dataset's own prompt (the prompt template's message)
    dataset = PromptRenderer(tokenizer, cfg.data.prompt_key, cfg.data.format_prompt, chat_template)
    environments = load_environments(mt, dataset.messages)
    total = mt.max_total_tokens or cfg.data.max_response_length
    budget = TurnBudget(mt.max_turns, total, mt.max_tokens_per_turn or total, cfg.data.max_prompt_length)
    tools = ToolSettings(mt.tool_timeout_s, mt.max_tool_output_chars, mt.max_parallel_tools, mt.max_env_error_ratio)
    return environments, ChatRenderer(tokenizer, chat_template), budget, tools
