"""Name -> function registries for advantage estimators and policy losses.

Both registries are plain module-level dictionaries wrapped in a small class so that a user can add an algorithm
from their own file with a decorator, and the trainer / config validator can look it up by the string in the YAML.
"""

from __future__ import annotations

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
    "list_advantage_estimators",
    "list_policy_losses",
    "register_advantage_estimator",
    "register_policy_loss",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(*, token_level_rewards (B, T), response_mask (B, T), index (B,), **kwargs) -> (advantages, returns)``."""

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
"""``fn(*, old_log_prob, log_prob, advantages, response_mask (all (B, T)), ..., **kwargs) -> (loss, metrics)``."""

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


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (selected by ``worker.actor.loss_type``).

    The function is called with keyword arguments ``old_log_prob, log_prob, advantages, response_mask`` (all
    (B, T)), ``clip_ratio_low, clip_ratio_high, clip_ratio_dual, tau_positive, tau_negative, loss_agg_mode``, optionally
    ``rollout_is_weights`` (B, T), and must return ``(scalar loss, metrics)``: the loss aggregated over the micro-batch
    it was given (``agg_loss`` with ``loss_agg_mode``; the trainer weighs micro-batches and ranks itself), metrics as
    floats or detached 0-dim tensors, each a mean over the micro-batch's valid tokens (reported token-weighted over
    the whole mini-batch).
    """
    register = _POLICY_LOSSES.register(name, override=override)

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        registered = register(fn)
        declare_policy_loss(name)  # for the config validator, as for estimators
        return registered

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss by name; unknown names raise ``UnknownNameError`` (KeyError + ValueError)."""
    return _POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses (built-in and user-registered)."""
    return _POLICY_LOSSES.names()
