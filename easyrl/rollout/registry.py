"""Rollout engines by name: `worker.rollout.name` picks one. The built-ins are `hf`, `vllm` and `diffusers` (a
diffusion pipeline, registered by `easyrl.diffusion.engine` itself); a user's engine is registered from a file of `algorithm.user_modules`
(imported on the driver, where the config validates the name, and in every worker, where the engine is built):

    from easyrl.rollout import EngineContext, register_engine

    @register_engine("my_engine", capabilities=EngineCapabilities(tensor_parallel=True))
    def build(ctx: EngineContext) -> RolloutEngine:
        return MyEngine(ctx.spec.model.model_path, ctx.device, ...)

A factory gets everything an engine needs resolved once (`EngineContext`) and returns a `RolloutEngine`; it imports
its engine's heavy dependencies inside, so naming an engine costs nothing until one is built. What the engine can do
(`config.engines.EngineCapabilities`: tensor parallelism, raw media, LoRA adapters, sleep levels, its environment)
is declared with it, and everything outside this package reads that record, never the engine's name; what `easyrl
check` should look at before a run starts is its `EngineCheck`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from easyrl.config.engines import (
    BUILTIN_ENGINE_CAPABILITIES,
    EngineCapabilities,
    declare_engine,
    engine_capabilities,
)
from easyrl.rollout.engine import EngineCheck, RolloutEngine
from easyrl.rollout.spec import RolloutSpec
from easyrl.rollout.vllm_check import VLLMCheck


@dataclass(frozen=True)
class EngineContext:
    """What an engine factory is given, resolved in the process that builds the engine."""

    spec: RolloutSpec
    """`worker.rollout` and the policy's model (the engine loads the same checkpoint)."""
    device: torch.device
    """The process's device (`easyrl.distributed.device`): an engine never picks a CUDA index itself."""
    dtype: torch.dtype
    """`worker.rollout.dtype` on a GPU; fp32 on CPU."""
    eos_token_ids: list[int]
    """Tokens that end a response (the tokenizer's EOS)."""
    pad_token_id: int
    """What pads the responses (the tokenizer's pad token, else its EOS)."""
    media_per_prompt: dict[str, int] = field(default_factory=dict)
    """The most images / videos one prompt of the data carries (an engine that processes pixels sizes itself)."""


EngineFactory = Callable[[EngineContext], RolloutEngine]
_ENGINES: dict[str, EngineFactory] = {}
_CHECKS: dict[str, EngineCheck] = {}


def register_engine(
    name: str,
    *,
    capabilities: EngineCapabilities | None = None,
    check: EngineCheck | None = None,
    override: bool = False,
) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: build the engine `worker.rollout.name: <name>` names with this factory. `capabilities` is what it
    can do (default: what a plain `RolloutEngine` can: one worker per engine, no adapters, no sleep levels); a config
    asking for more is refused. `check` is what `easyrl check` runs for it (default: nothing). A name taken already
    is refused unless `override` (a silent replacement would change a run's engine without a word)."""

    def decorator(factory: EngineFactory) -> EngineFactory:
        if name in _ENGINES and not override:
            raise ValueError(
                f"rollout engine {name!r} is already registered (by {_ENGINES[name].__qualname__}); "
                "pass override=True to replace it"
            )
        _ENGINES[name] = factory
        _CHECKS[name] = check or EngineCheck()
        # the config validator accepts the name, and knows what it can do, from now on without importing this module
        declare_engine(name, capabilities or EngineCapabilities())
        return factory

    return decorator


def engine_factory(name: str) -> EngineFactory:
    """The factory registered under `name`; a name never registered is one line listing the known ones."""
    engine_capabilities(name)  # a name never declared: the one line listing the known ones
    if name not in _ENGINES:
        raise ValueError(
            f"rollout engine {name!r} is declared but not registered in this process: "
            f"import {REGISTERED_ELSEWHERE.get(name, 'the module that registers it')} before building it"
        )
    return _ENGINES[name]


def engine_check(name: str) -> EngineCheck:
    """What `easyrl check` runs for the engine registered under `name`."""
    engine_capabilities(name)
    return _CHECKS.get(name, EngineCheck())  # an engine registered by a room of its own has no check to run here


@register_engine("hf", capabilities=BUILTIN_ENGINE_CAPABILITIES["hf"])
def _hf_engine(ctx: EngineContext) -> RolloutEngine:
    from easyrl.rollout.hf import HFRolloutEngine

    model = ctx.spec.model
    assert model.model_path is not None
    return HFRolloutEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )


@register_engine("vllm", capabilities=BUILTIN_ENGINE_CAPABILITIES["vllm"], check=VLLMCheck())
def _vllm_engine(ctx: EngineContext) -> RolloutEngine:
    from easyrl.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(ctx.spec, ctx.eos_token_ids, ctx.pad_token_id, ctx.media_per_prompt)


# `diffusers` is declared with the built-ins (the config validates it without importing torch) but registered by its
# own room, `easyrl.diffusion.engine`, which the denoiser actor that hosts it imports: an engine built on the
# diffusion room's guided forward cannot be built from here without the rollout room importing the room above it.
REGISTERED_ELSEWHERE = {"diffusers": "easyrl.diffusion.engine"}
assert set(_ENGINES) | set(REGISTERED_ELSEWHERE) == set(BUILTIN_ENGINE_CAPABILITIES), (
    "config.engines lists the built-in engines' capabilities"
)
