"""Name -> function registries for advantage estimators and policy losses.

Both registries are plain module-level dictionaries wrapped in a small class so that a user can add an algorithm
from their own file with a decorator, and the trainer / config validator can look it up by the string in the YAML.
A policy loss also registers the frozen dataclass of its knobs, whose fields are `worker.actor` keys.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from easyrl.config.names import (
    GROUP_ESTIMATORS,
    EstimatorNeeds,
    declare_estimator,
    declare_policy_loss,
    declared_needs,
)
from easyrl.config.worker import ActorConfig


__all__ = [
    "GROUP_ESTIMATORS",
    "AdvantageFn",
    "EstimatorNeeds",
    "PolicyLossFn",
    "Registry",
    "UnknownNameError",
    "estimator_needs",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_policy_loss_params",
    "list_advantage_estimators",
    "list_policy_losses",
    "policy_loss_params",
    "policy_loss_with_params",
    "register_advantage_estimator",
    "register_policy_loss",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(*, token_level_rewards (B, T), response_mask (B, T), index (B,), **kwargs) -> (advantages, returns)``."""

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
"""``fn(*, old_log_prob, log_prob, advantages, response_mask (all (B, T)), loss_agg_mode, rollout_is_weights,
params) -> (loss, metrics)``; ``params`` only for a loss registered with a params class."""

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered.

    It is both a ``KeyError`` (it is a failed lookup) and a ``ValueError`` (it usually comes from a bad config
    value), so callers can catch whichever reads more naturally.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes; show it as written.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """A mapping from names to functions of one kind (``kind`` is used in error messages only)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Return a decorator that stores the decorated function under ``name`` and returns it unchanged.

        Registering a name twice raises ``ValueError`` unless ``override=True`` (silently replacing a built-in
        algorithm by importing a file would be a hard-to-find bug).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._entries and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._entries[name].__qualname__}); "
                    "pick another name or pass override=True"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """Return the function registered under ``name``; raise ``UnknownNameError`` listing the known names."""
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Sorted list of registered names."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


_ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_advantage_estimator(
    name: str, *, override: bool = False, needs: EstimatorNeeds | None = None
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``name`` (selected by ``algorithm.adv_estimator``).

    The function is called as ``fn(token_level_rewards=R, response_mask=M, index=idx, **extra)`` with R, M of
    shape (B, T) and idx a length-B sequence of group ids; it must return ``(advantages, returns)``, both (B, T),
    and accept ``**kwargs`` for the extras it does not use. ``needs`` declares what it takes from the run (a critic
    fills ``values``, a greedy baseline ``reward_baselines``; grouped estimators need ``rollout.n >= 2``).
    """
    register = _ADVANTAGE_ESTIMATORS.register(name, override=override)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        registered = register(fn)
        # the torch-free table the config validator reads (it never imports this registry)
        declare_estimator(name, needs or EstimatorNeeds())
        return registered

    return decorator


def estimator_needs(name: str) -> EstimatorNeeds:
    """What the estimator registered under ``name`` declared it needs; unknown names raise ``UnknownNameError``."""
    _ADVANTAGE_ESTIMATORS.get(name)
    return declared_needs(name)


def get_advantage_estimator(name: str) -> AdvantageFn:
    """Look up an advantage estimator by name; unknown names raise ``UnknownNameError`` (KeyError + ValueError)."""
    return _ADVANTAGE_ESTIMATORS.get(name)


def list_advantage_estimators() -> list[str]:
    """Sorted names of all registered advantage estimators (built-in and user-registered)."""
    return _ADVANTAGE_ESTIMATORS.names()


_ACTOR_KEYS = frozenset(f.name for f in dataclasses.fields(ActorConfig))
"""The `worker.actor` keys: the names a policy loss's params fields may take (the config fills them by name)."""

_LOSS_PARAMS: dict[str, type | None] = {}
"""Loss name -> the params dataclass it registered (None: it takes no knobs)."""


def register_policy_loss(
    name: str, *, params: type | None = None, override: bool = False
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (selected by ``worker.actor.loss_type``).

    The function is called with keyword arguments ``old_log_prob, log_prob, advantages, response_mask`` (all
    (B, T)), ``loss_agg_mode``, ``rollout_is_weights`` ((B, T) or None) and, when the loss declares ``params`` (a
    frozen dataclass whose fields are ``worker.actor`` keys, e.g. ``clip_ratio_low``), ``params``: that dataclass
    filled from the config by field name. A loss registered without ``params`` gets no knobs. It must return
    ``(scalar loss, metrics)``: the loss aggregated over the micro-batch it was given (``agg_loss`` with
    ``loss_agg_mode``; the trainer weighs micro-batches and ranks itself), metrics as floats or detached 0-dim
    tensors, each a mean over the micro-batch's valid tokens (reported token-weighted over the whole mini-batch).
    """
    if params is not None:
        _check_params_class(name, params)
    register = _POLICY_LOSSES.register(name, override=override)

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        _check_no_knob_arguments(name, fn)
        registered = register(fn)
        _LOSS_PARAMS[name] = params
        declare_policy_loss(name)  # for the config validator, as for estimators
        return registered

    return decorator


def _check_params_class(name: str, params: type) -> None:
    """A loss's params: a frozen dataclass (its knobs are constants of the run) whose every field the config can
    fill; a field it cannot would otherwise surface only when a run builds its specs."""
    # `__dataclass_params__` is where dataclasses records `frozen=`; there is no public accessor for it
    frozen = getattr(getattr(params, "__dataclass_params__", None), "frozen", False)
    if not (isinstance(params, type) and dataclasses.is_dataclass(params) and frozen):
        raise TypeError(f"policy loss {name!r}: params must be a @dataclass(frozen=True) class, got {params!r}")
    unknown = [f.name for f in dataclasses.fields(params) if f.name not in _ACTOR_KEYS]
    if unknown:
        raise ValueError(
            f"policy loss {name!r}: params field(s) {', '.join(map(repr, unknown))} of {params.__qualname__} are not "
            "worker.actor keys, so the config cannot fill them; name each field after the worker.actor key it "
            "reads (e.g. clip_ratio_low, tau_positive) or make it a constant of the loss"
        )


def _check_no_knob_arguments(name: str, fn: PolicyLossFn) -> None:
    """Knobs reach a loss only through ``params``: an argument named after a ``worker.actor`` key would silently
    keep its default (losses used to get every knob as a keyword argument), so it is refused."""
    try:
        arguments = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return
    knobs = [a for a in arguments if a in _ACTOR_KEYS]
    if knobs:
        raise TypeError(
            f"policy loss {name!r} takes {', '.join(map(repr, knobs))} as an argument, which is never passed: "
            "declare a frozen params dataclass with those fields (register_policy_loss(name, params=...)) and read "
            "them as params.<field>"
        )


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss by name; unknown names raise ``UnknownNameError`` (KeyError + ValueError)."""
    return _POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses (built-in and user-registered)."""
    return _POLICY_LOSSES.names()


def get_policy_loss_params(name: str) -> type | None:
    """The params dataclass the loss ``name`` registered (None: it takes no knobs); unknown names raise
    ``UnknownNameError``."""
    _POLICY_LOSSES.get(name)
    return _LOSS_PARAMS[name]


def policy_loss_params(name: str, source: object) -> tuple[tuple[str, Any], ...]:
    """The knobs of the loss ``name`` as ``(field, value)`` pairs, read from ``source`` (the ``worker.actor``
    config) by the field names of its params class; () for a loss without one.

    The class is built here, so a bad value fails on the driver. Pairs, not the instance, travel to the workers: a
    user's class lives in an ``algorithm.user_modules`` file that a worker imports only after its spec has arrived,
    so an instance of it could not be unpickled there.
    """
    params_cls = get_policy_loss_params(name)
    if params_cls is None:
        return ()
    values = {f.name: getattr(source, f.name) for f in dataclasses.fields(params_cls)}
    params_cls(**values)  # validates (a params class may check its values in __post_init__)
    return tuple(values.items())


def policy_loss_with_params(name: str, values: tuple[tuple[str, Any], ...]) -> PolicyLossFn:
    """The loss ``name`` with its params class, built from ``values`` (`policy_loss_params`'s pairs), bound as
    ``params``; the loss itself when it registered none."""
    fn = get_policy_loss(name)
    params_cls = get_policy_loss_params(name)
    if params_cls is None:
        return fn
    return functools.partial(fn, params=params_cls(**dict(values)))
