"""What the run does where the config leaves the choice open (a null that means "auto") or implies it: decided once, on
the driver, from the validated config, for the role specs, the trainer and `easyrl check`.

They are decisions, not checks, so they live above the config: the estimator's needs come from the algorithm
registry, which the config must not import (it sits below the algorithms).
"""

from __future__ import annotations

from collections.abc import Callable

from easyrl.algorithms import EstimatorNeeds
from easyrl.algorithms import estimator_needs as registered_needs
from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout import RolloutLoop, SingleTurnLoop, WeightSync
from easyrl.rollout.carry_over import CarryOverLoop


def estimator_needs(cfg: EasyRLConfig) -> EstimatorNeeds:
    """What `algorithm.adv_estimator` declared it needs, as registered (a user's `algorithm.user_modules` included)."""
    return registered_needs(cfg.algorithm.adv_estimator)


def effective_sleep_level(cfg: EasyRLConfig) -> int:
    """`worker.rollout.sleep_level`, or when null: 1 when the engine keeps its base weights across steps (LoRA with
    `rollout_sync: adapter` sends only the adapters), else 2 (each wake is followed by a full weight sync, so the
    level-1 copy of the weights to host memory and back would be thrown away)."""
    level = cfg.worker.rollout.sleep_level
    if level is not None:
        return level
    lora = cfg.worker.actor.model.lora
    return WeightSync.resolve(lora.rank, lora.rollout_sync).sleep_level  # the one rule, shared with the spec


def effective_padding_free(cfg: EasyRLConfig, on_gpu: bool) -> bool:
    """`worker.actor.padding_free`, or when null: packed rows on GPUs (the varlen kernels skip the padding) and
    whenever a role splits rows with Ulysses (it needs packed rows), padded rows on CPU (per-sequence attention over
    packed rows is slower there than one padded batch: 0.30 s against 0.18 s per demo update)."""
    explicit = cfg.worker.actor.padding_free
    if explicit is not None:
        return explicit
    return on_gpu or cfg.worker.actor.ulysses_size > 1 or cfg.worker.critic.ulysses_size > 1


def data_parallel_size(cfg: EasyRLConfig, role: str = "actor") -> int:
    """Workers holding different samples: all workers / `worker.<role>.ulysses_size` (the ranks of a
    sequence-parallel group share their samples)."""
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // int(getattr(cfg.worker, role).ulysses_size)


def effective_chunk_tokens(cfg: EasyRLConfig) -> int:
    """`worker.rollout.chunk_tokens`, or when null a quarter of `data.max_response_length` rounded up: each response
    then takes up to four engine calls, and a step's session can end between any two of them."""
    return cfg.worker.rollout.chunk_tokens or -(-cfg.data.max_response_length // 4)


def rollout_engines(cfg: EasyRLConfig) -> int:
    """How many engines a generate call is split over: the actor's workers (colocated) or the rollout workers
    (separate), over the workers one engine spans."""
    rollout = cfg.worker.rollout
    workers = rollout.n_gpus if rollout.placement == "separate" else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return workers // rollout.ranks_per_engine


def rollout_loop(
    cfg: EasyRLConfig,
    draw: Callable[[int], Batch] | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    on_finished: Callable[[Batch], None] | None = None,
) -> RolloutLoop:
    """How the trainer turns prompts into rows: one engine session per batch, one response per sample
    (`SingleTurnLoop`), several turns with tools between them when `worker.rollout.multi_turn` sets an environment
    or tools (`MultiTurnLoop`), or with `trainer.max_staleness` >= 1 groups kept in flight across steps
    (`CarryOverLoop`, which draws prompts of its own with `draw` to fill them, and ends responses at `eos_id` and
    `worker.rollout.stop_token_ids` as the engines do, handing each call's finished groups to `on_finished`, and
    generating beside the training when the engines are separate). A new
    loop is chosen here from the config section that turns it on; `fit()` does not change (docs/architecture.md,
    "Adding a rollout loop")."""
    staleness, rollout = cfg.trainer.max_staleness, cfg.worker.rollout
    if rollout.multi_turn.enabled:  # validation refuses multi-turn with max_staleness >= 1 (not built yet)
        return multi_turn_loop(cfg)
    if staleness == 0:
        return SingleTurnLoop()
    assert draw is not None, "an asynchronous loop draws prompts of its own"
    per_step = cfg.data.rollout_batch_size
    stop_ids = [] if rollout.ignore_eos else [*([eos_id] if eos_id is not None else []), *rollout.stop_token_ids]
    return CarryOverLoop(
        draw,
        max_staleness=staleness,
        active_groups=rollout.active_groups or (staleness + 1) * per_step,
        chunk_tokens=effective_chunk_tokens(cfg),
        max_response_length=cfg.data.max_response_length,
        stop_ids=stop_ids,
        pad_id=pad_id,
        engines=rollout_engines(cfg),
        on_finished=on_finished,
        beside=rollout.placement == "separate",  # engines of their own generate while the policy trains
    )


def one_session_loop(cfg: EasyRLConfig, loop: RolloutLoop) -> RolloutLoop:
    """The loop for validation and ReMax's greedy baselines, which take one engine session per call and keep nothing
    in flight: the run's multi-turn loop itself (the tools are part of what is measured), else the single-turn one
    (a carry-over loop's groups in flight are training work, never validation's)."""
    return loop if cfg.worker.rollout.multi_turn.enabled else SingleTurnLoop()


def multi_turn_loop(cfg: EasyRLConfig) -> RolloutLoop:
    """The multi-turn loop of `worker.rollout.multi_turn`: its environments and tools imported (a tool without type
    hints or docstring stops the run here, before any worker starts), the policy's tokenizer and chat template."""
    from easyrl.agent import load_environments
    from easyrl.data.prompts import PromptRenderer, load_chat_template
    from easyrl.models import load_tokenizer
    from easyrl.rollout.multi_turn import ChatRenderer, MultiTurnLoop, ToolSettings, TurnBudget

    mt, model = cfg.worker.rollout.multi_turn, cfg.worker.actor.model
    assert model.tokenizer_path is not None
    tokenizer, _ = load_tokenizer(model.tokenizer_path, trust_remote_code=model.trust_remote_code)
    chat_template = load_chat_template(cfg.data.override_chat_template)
    # without an environment a trajectory opens with the dataset's own prompt (the prompt template's message)
    dataset = PromptRenderer(tokenizer, cfg.data.prompt_key, cfg.data.format_prompt, chat_template)
    environments = load_environments(mt, dataset.messages)
    total = mt.max_total_tokens or cfg.data.max_response_length
    budget = TurnBudget(mt.max_turns, total, mt.max_tokens_per_turn or total, cfg.data.max_prompt_length)
    tools = ToolSettings(mt.tool_timeout_s, mt.max_tool_output_chars, mt.max_parallel_tools)
    return MultiTurnLoop(environments, ChatRenderer(tokenizer, chat_template), budget, tools, rollout_engines(cfg))
