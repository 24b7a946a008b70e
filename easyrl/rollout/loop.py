"""The driver's side of the rollout seam: a `RolloutLoop` turns a batch of prompts into rows to train on, driving
the engines through an `EngineSession` (the workers that hold them, seen from the driver).

The trainer owns *what* to sample (which prompts, how many samples, the sampling settings and their seed); a loop
owns *how*. The producer builds one schedule, `carry_over.CarryOverLoop`, driving any episode: at
`trainer.max_staleness = 0` the synchronous one (one engine session per batch; `multi_turn.MultiTurnLoop` is it with
the tool episode), at S >= 1 with requests kept in flight across steps. `SingleTurnLoop` is the engines' own rows
for one response per sample in one call, which the schedule at S = 0 gives to the bit: the reference its tests
compare against and the smallest loop a recipe starts from (`OneSessionLoop`). Whatever the loop, the rows it
returns follow one contract (`RolloutEngine.generate`'s fields, plus the prompts' own columns and `policy_version`;
the loops that build rows from `Trajectory` records add `token_policy_version` and `rollout_sessions`), so `fit()`
reads the same for every loop: it holds this module's `RolloutLoop` protocol, never a loop class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from easyrl.batch import Batch
from easyrl.rollout.engine import SamplingParams
from easyrl.seeding import SEED_COLUMN, prompt_seeds


logger = logging.getLogger(__name__)

Scored = tuple[list[dict[str, float]], dict[str, float], list[str]]
"""Per-sample scores, the reward manager's metrics, and the decoded responses of a batch of rows."""
Scorer = Callable[[Batch], Scored]
"""The trainer's reward call on rows (decode, call the reward function)."""

ENGINE_COLUMNS = ("multi_modal_inputs", "rollout_prompt", "raw_prompt")
"""The prompts' non-tensor columns an engine reads (processed media; the raw prompt with its media for vLLM; the
rendered prompt text, which an image engine encodes with its own text encoders: `easyrl.diffusion.engine`). The
rest (rows, answers) stays on the driver instead of being sent to every engine."""


class EngineSession(Protocol):
    """The engines as a loop drives them (the actor group in the HybridEngine). Every call reaches every engine;
    `generate` splits its prompts over them and gathers the rows in order."""

    def open_rollout(self) -> dict[str, float]:
        """Wake the engines (pushing new weights where the policy moved); returns their timings."""
        ...

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """`params.n` samples per prompt with the weights the engines hold; no lifecycle inside."""
        ...

    def close_rollout(self) -> dict[str, float]:
        """Put the engines to sleep; returns their timings."""
        ...

    def policy_version(self) -> int:
        """The policy's version (its `update_actor` calls): what the engines hold once a session is open."""
        ...

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """Open, generate, close in one call per engine (one round trip instead of three)."""
        ...


class PendingRows(Protocol):
    """A generate call under way (a worker group's `GroupCall`)."""

    def result(self) -> tuple[Batch, dict[str, float]]:
        """Wait for it: the rows and the session's timings."""
        ...


class BesideSession(EngineSession, Protocol):
    """Engines on devices of their own (`worker.rollout.placement: separate`), which can generate while the policy
    trains: the carry-over loop starts a call before handing the step over and collects it at the next step."""

    def generate_beside(self, prompts: Batch, params: SamplingParams) -> tuple[dict[str, float], PendingRows]:
        """Push the policy's weights if it moved, start open-generate-close and return at once (the push's timings
        and the call)."""
        ...


class RolloutLoop(Protocol):
    """Turns prompts into trainable rows, and owns whatever it keeps between calls: the trainer holds this protocol,
    never a concrete loop, so a loop that keeps work in flight (`carry_over.CarryOverLoop`) saves, restores, settles
    and scores it behind these methods, and one that keeps nothing (`OneSessionLoop`) does nothing there."""

    def run(self, engines: EngineSession, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """The rows for `prompts` (B prompts with the driver's columns in; B*n rows out, sample `j` of prompt `i` at
        row `i*n + j`, each with its prompt's columns) and the session's timings. `params.seed` is set: it seeds
        every sample (`seeded_request`), so the rows do not depend on how many engines share the work."""
        ...

    def score(self, rows: Batch, scorer: Scorer) -> Scored:
        """The scores of `rows` (a training batch this loop returned, or validation's rows): every reward call of the
        run goes through here, so a loop that scores finished groups beside the engines hands those results back,
        calls `scorer` for the rest, and never lets two reward calls run at once."""
        ...

    def settle(self) -> None:
        """Collect work still running between steps (a call beside the update), so `state_dict` holds its result."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the loop keeps between calls (JSON-able; empty when nothing): part of the trainer's checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` (a resume, or a step undone on a stop signal); `{}`: a run that kept nothing."""
        ...

    def close(self) -> None:
        """Stop what the loop runs in the background (a scorer thread)."""
        ...


class OneSessionLoop:
    """What a loop that keeps nothing between calls does besides `run` (the synchronous schedule): it scores on the
    spot, has nothing to settle or save, and warns when given the work in flight of an asynchronous run's checkpoint
    (resumed with `trainer.max_staleness: 0`, those groups are not trained)."""

    def score(self, rows: Batch, scorer: Scorer) -> Scored:
        return scorer(rows)

    def settle(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warn_untrained(state)

    def close(self) -> None:
        return None


def warn_untrained(state: dict[str, Any]) -> None:
    """A synchronous schedule given an asynchronous run's checkpoint: its groups in flight are not trained (said once,
    loudly)."""
    if state:
        logger.warning(
            "the checkpoint holds %d prompt groups in flight (trainer.max_staleness was >= 1); trainer."
            "max_staleness: 0 does not carry them over",
            len(state.get("groups", [])) + len(state.get("queue", [])),
        )


def seeded_request(prompts: Batch, params: SamplingParams) -> Batch:
    """What the engines get for `prompts`: the tensors and `ENGINE_COLUMNS`, with each prompt's seed in the
    `sample_seed` column, made from its index in this whole batch before the batch is split over the engines (so a
    prompt samples alike on whichever engine draws it: `easyrl.seeding`)."""
    if params.seed is None:
        raise ValueError("a rollout loop needs params.seed: the trainer derives one per call (easyrl.seeding)")
    request = prompts.select(*prompts.tensors, *ENGINE_COLUMNS)
    return request.set(**{SEED_COLUMN: prompt_seeds(params.seed, len(request), params.n)})


def with_prompts(prompts: Batch, rows: Batch, params: SamplingParams) -> Batch:
    """The engines' rows beside their prompts' driver columns (each prompt repeated for its `n` samples)."""
    if not params.logprobs:  # the engines fill zeros where none were asked for: nothing to compare against
        rows.tensors.pop("rollout_log_probs", None)
    return prompts.repeat_interleave(params.n).union(rows)


class SingleTurnLoop(OneSessionLoop):
    """One response per sample, in one engine session per call: today's synchronous loop. The three lifecycle steps
    go as one call per engine (`generate_sequences`): the same work as open / generate / close, one round trip."""

    def run(self, engines: EngineSession, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        rows, timings = engines.generate_sequences(seeded_request(prompts, params), params)
        return with_prompts(prompts, rows, params), timings
