"""The one place that picks how prompts become rows from the config: the schedule's bound (`trainer.max_staleness`: 0 is
the synchronous schedule, the carry-over loop at S = 0) and the episode (one completion, or turns with tools between
them).
The trainer gets a `RolloutLoop` from here and drives it through that protocol alone (`tests/test_structure.py`:
nothing under `trainer/` names a concrete loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout.loop import RolloutLoop, Scorer, SingleTurnLoop


if TYPE_CHECKING:
    from easyrl.rollout.multi_turn import MultiTurnLoop


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
    whole: bool = False,
) -> RolloutLoop:
    """The one schedule, `CarryOverLoop`, at the run's bound: `trainer.max_staleness` = 0 is the synchronous schedule
    (one engine session per batch, nothing kept between calls: docs/async.md, "S = 0"); S >= 1 keeps groups in flight
    across steps, draws prompts of its own with `draw`, scores each call's finished groups with `scorer` beside the
    engines and generates beside the training when the engines are separate. It drives the tool episode when
    `worker.rollout.multi_turn` sets an environment or tools, else the single-turn one, and ends responses at `eos_id`
    and `worker.rollout.stop_token_ids` as the engines do. The schedule and episode come decided (the trainer's run
    plan, `easyrl.trainer.plan`), not re-read: `engines`, how many engines a call is split over; `chunk_tokens`, the
    carry-over call's length; `staleness`, the bound; `tools`, the tool episode; `beside`, engines of their own that
    generate while the policy trains. `whole`: the engine returns each sample whole in one call (a diffusion
    pipeline's images: no tokens to continue or carry over), so the loop is one engine call per batch."""
    from easyrl.rollout.carry_over import CarryOverLoop, never_draws
    from easyrl.rollout.multi_turn import ToolEpisode

    if whole:
        assert staleness == 0, "the config refuses trainer.max_staleness >= 1 for an engine without tokens"
        return SingleTurnLoop()
    assert draw is not None or staleness == 0, "an asynchronous loop draws prompts of its own"
    rollout = cfg.worker.rollout
    per_step = cfg.data.rollout_batch_size
    stop_ids = [] if rollout.ignore_eos else [*([eos_id] if eos_id is not None else []), *rollout.stop_token_ids]
    return CarryOverLoop(
        draw or never_draws,
        max_staleness=staleness,
        active_groups=rollout.active_groups or (staleness + 1) * per_step,
        chunk_tokens=chunk_tokens,
        max_response_length=cfg.data.max_response_length,
        stop_ids=stop_ids,
        pad_id=pad_id,
        engines=engines,
        scorer=scorer if staleness else None,  # synchronous: a step's rows are scored on the spot, as they are handed
        beside=beside,
        episode=ToolEpisode(*tool_parts(cfg)) if tools else None,
    )


def one_session_loop(
    cfg: EasyRLConfig, loop: RolloutLoop, engines: int, *, staleness: int, tools: bool, whole: bool = False
) -> RolloutLoop:
    """The loop for validation and ReMax's greedy baselines, which take one engine session per call and keep nothing
    in flight: the run's own at S = 0 (it keeps nothing between calls; with tools, they are part of what is
    measured), else the same schedule at S = 0 with the run's episode (a carry-over loop's groups in flight are
    training work, never validation's)."""
    from easyrl.rollout.carry_over import CarryOverLoop, never_draws
    from easyrl.rollout.multi_turn import ToolEpisode

    if staleness == 0 or whole:
        return loop
    assert isinstance(loop, CarryOverLoop), "build_rollout_loop builds every schedule"
    return CarryOverLoop(
        never_draws,
        max_staleness=0,
        active_groups=loop.active_groups,
        chunk_tokens=loop.chunk_tokens,
        max_response_length=loop.max_len,
        stop_ids=sorted(loop.stop_ids),
        pad_id=loop.pad_id,
        engines=engines,
        beside=loop.generates_beside,
        episode=ToolEpisode(*tool_parts(cfg)) if tools else None,
    )


def multi_turn_loop(cfg: EasyRLConfig, engines: int) -> MultiTurnLoop:
    """The synchronous schedule with the tool episode of `worker.rollout.multi_turn` (`tool_parts`), as `easyrl check`
    builds it to load the tools early."""
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
