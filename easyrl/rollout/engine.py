"""The rollout engine interface shared by the vLLM and HF engines, and the sampling settings of one call.

An engine is held by a `RolloutWorker` (`easyrl.rollout.worker`) in the process that serves rollouts; today that is
the actor's (the HybridEngine): it generates from the policy's current weights, which are streamed into it in
memory after every update (`load_weights`), and it releases its accelerator memory while the policy trains (`sleep` /
`wake_up`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from easyrl.batch import Batch
from easyrl.seeding import SEED_COLUMN, prompt_seeds


if TYPE_CHECKING:
    from easyrl.config import EasyRLConfig
    from easyrl.rollout.media_embeds import MediaEmbeds


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Responses per prompt: B prompts give B*n rows, sample `j` of prompt `i` at row `i * n + j`."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-call seed (see `easyrl.seeding`): the same seed and weights give the same samples. The driver's calls
    carry each prompt's own seed in the prompts' `sample_seed` column instead, made from this one."""
    logprobs: bool = True
    """Return the engine's log-prob of each sampled token."""
    denoising_steps: int | None = None
    """A diffusion engine's denoising steps per sample (None: `worker.rollout.diffusion.num_steps`; validation sets
    `val_num_steps`); text engines ignore it."""

    def override(self, changes: dict[str, Any]) -> SamplingParams:
        """A copy with `changes` applied (e.g. `val_override_config`)."""
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {sorted(self.__dataclass_fields__)}")
        if "stop_token_ids" in changes:
            changes = {**changes, "stop_token_ids": tuple(changes["stop_token_ids"])}
        return replace(self, **changes)


class RolloutEngine(ABC):
    """Generates responses for left-padded prompts.

    `generate` takes a batch with `input_ids` (B, P) left-padded, `attention_mask` (B, P), `position_ids`
    (B, P) and returns, for N = B * `params.n` rows (the samples of one prompt next to each other): `prompts`
    (N, P), `responses` (N, R) right-padded with the pad id, `response_mask` (N, R) (1 up to and including EOS),
    `loss_mask` (N, R) (the tokens trained on: `response_mask` for a single-turn response),
    `input_ids`/`attention_mask`/`position_ids` (N, P+R) for the whole sequence, and `rollout_log_probs` (N, R)
    (zeros where not requested).
    """

    discards_weights_on_sleep = False
    """Whether `sleep` drops the weights (vLLM sleep level 2): they must be loaded again before generating."""
    media_embeds: MediaEmbeds | None = None
    """Where the engine takes held vision-tower outputs from in place of pixels, and its counts of both
    (`easyrl.rollout.media_embeds`; set by the `RolloutWorker` for a vision-language policy)."""
    loads_tied_aliases = False
    """Whether `load_weights` needs a tied parameter under each of its names (vLLM: its in-place reload processes
    each layer from what it is given), or once (the HF engine, whose tied head is its embedding)."""

    @abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights in memory, one (HF parameter name, full tensor) pair at a time."""

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any]) -> None:
        """Serve the base model with these LoRA adapters (PEFT layout) from now on; engines without LoRA support
        refuse (the merged weights reach any engine through `load_weights`)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot serve LoRA adapters: set worker.actor.model.lora.rollout_sync=merged"
        )

    def sleep(self) -> None:  # noqa: B027  (optional hook: engines without sleep mode keep the no-op)
        """Release accelerator memory (weights and KV cache) until `wake_up`. No-op where unsupported."""

    def wake_up(self, tags: list[str] | None = None) -> None:  # noqa: B027
        """Re-acquire memory: `["weights"]` before `load_weights`, `["kv_cache"]` before generating."""

    def recover(self) -> bool:
        """After a `generate` that raised: drop what the failed call left behind (its requests, cached memory) and say
        whether the engine can take requests again with the weights it holds. False (the default: nothing known about
        the engine's state) means its state is lost: `RolloutWorker` then rebuilds it and pushes the weights again."""
        return False

    def discard(self) -> None:  # noqa: B027  (optional hook: an engine with nothing to release keeps the no-op)
        """Release what this engine holds before a replacement is built in the same process (it is not used again)."""


class EngineFailedError(RuntimeError):
    """A rollout engine failed again after its restart in the same step, or could not be restarted: the run stops
    with this one line (the engine, the step, the first error)."""

    one_line = True
    """The driver shows the message alone, not the remote traceback (`distributed.liveness.to_group_error`)."""


class EngineCheck:
    """What `easyrl check` asks of an engine before a run, without starting it; registered with the engine
    (`register_engine(..., check=...)`). This base has nothing to say: an engine with more to check overrides it."""

    def problem(self, cfg: EasyRLConfig, on_gpu: bool) -> str | None:
        """What would stop the engine from starting on this machine (a missing package, a model it cannot serve)."""
        return None

    def plan_lines(self, cfg: EasyRLConfig) -> list[str]:
        """The engine's lines in the printed plan (its arguments, the kernels it will pick)."""
        return []

    def version_warning(self, on_gpu: bool) -> str | None:
        """Why the installed version of the engine is not one easyrl has run on this kind of machine, if so."""
        return None


@torch.no_grad()
def copy_weights_into(params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]], owner: str) -> int:
    """Copy each named tensor of `weights` into `params` (a module's parameters by name) in place, so the tensors, tied
    ones included, stay the same objects; a name the module lacks is one `KeyError` naming `owner`. Returns the count."""
    loaded = 0
    for name, tensor in weights:
        target = params.get(name)
        if target is None:
            raise KeyError(f"{owner} has no parameter {name!r}")
        target.copy_(tensor.to(target.device, target.dtype))
        loaded += 1
    return loaded


def seeds_of_prompts(prompts: Batch, params: SamplingParams, unseeded: int) -> list[int]:
    """The seed of sample 0 of each prompt (sample `j` takes it plus `j`): the `sample_seed` column the driver
    attached to its whole batch before splitting it over the engines, so a prompt samples alike on any engine. A
    batch without it (an engine driven directly: tests, benchmarks) is taken for a whole batch seeded with
    `params.seed`, or `unseeded` when that is None."""
    if SEED_COLUMN in prompts:
        return [int(s) for s in prompts[SEED_COLUMN].tolist()]
    seed = params.seed if params.seed is not None else unseeded
    return prompt_seeds(seed, len(prompts["input_ids"]), params.n).tolist()


def assemble_sequences(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    eos_ids: set[int],
    pad_id: int,
    log_probs: torch.Tensor,
) -> Batch:
    """Build the full-sequence fields from left-padded prompts and raw responses (B, R).

    Everything after the first EOS (or stop token) is replaced by padding and masked out.
    """
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for tok in eos_ids:
        is_stop |= responses == tok
    # A token is valid when no stop token came strictly before it.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    response_mask = (stops_before == 0).to(prompt_mask.dtype)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    log_probs = log_probs * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)
    return Batch(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            # Single turn: every generated token is trained on. A multi-turn rollout zeroes its tool output here
            # while `response_mask` (attention) keeps it.
            "loss_mask": response_mask.clone(),
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "rollout_log_probs": log_probs.float(),
        }
    )
