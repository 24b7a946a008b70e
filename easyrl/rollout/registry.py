"""Rollout engines by name: `worker.rollout.name` picks one. The built-ins are `hf` and `vllm`; a user's engine is
registered from a file of `algorithm.user_modules` (imported on the driver, where the config validates the name, and
in every worker, where the engine is built):

    from easyrl.rollout import EngineContext, register_engine

    @register_engine("my_engine")
    def build(ctx: EngineContext) -> RolloutEngine:
        return MyEngine(ctx.spec.model.model_path, ctx.device, ...)

A factory gets everything an engine needs resolved once (`EngineContext`) and returns a `RolloutEngine`; it imports
its engine's heavy dependencies inside, so naming an engine costs nothing until one is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from easyrl.config.names import BUILTIN_ENGINES, declare_engine, declared_engines
from easyrl.rollout.engine import RolloutEngine
from easyrl.rollout.spec import RolloutSpec


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


def register_engine(name: str, *, override: bool = False) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: build the engine `worker.rollout.name: <name>` names with this factory. A name taken already is
    refused unless `override` (a silent replacement would change a run's engine without a word)."""

    def decorator(factory: EngineFactory) -> EngineFactory:
        if name in _ENGINES and not override:
            raise ValueError(
                f"rollout engine {name!r} is already registered (by {_ENGINES[name].__qualname__}); "
                "pass override=True to replace it"
            )
        _ENGINES[name] = factory
        declare_engine(name)  # the config validator accepts the name from now on, without importing this module
        return factory

    return decorator


def engine_factory(name: str) -> EngineFactory:
    """The factory registered under `name`; a name never registered is one line listing the known ones."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise KeyError(
            f"worker.rollout.name={name!r} is not a registered rollout engine; known: {', '.join(declared_engines())}"
            " (a user's engine registers itself with easyrl.rollout.register_engine in a file of "
            "algorithm.user_modules)"
        ) from None


@register_engine("hf")
def _hf_engine(ctx: EngineContext) -> RolloutEngine:
    from easyrl.rollout.hf import HFRolloutEngine

    model = ctx.spec.model
    assert model.model_path is not None
    return HFRolloutEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )


@register_engine("vllm")
def _vllm_engine(ctx: EngineContext) -> RolloutEngine:
    from easyrl.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(ctx.spec, ctx.eos_token_ids, ctx.pad_token_id, ctx.media_per_prompt)


assert set(_ENGINES) == set(BUILTIN_ENGINES), "config.names.BUILTIN_ENGINES lists the built-in engines"
