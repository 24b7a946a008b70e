"""Coefficient controllers: KL-in-reward (fixed / adaptive) and Skywork-OR1 adaptive entropy."""

from __future__ import annotations

from typing import Any


__all__ = [
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "get_kl_controller",
]


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op so both controllers can be driven the same way."""

    def __init__(self, kl_coef: float) -> None:
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the observation (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), steering the observed KL towards ``target_kl``.

    On ``update(current_kl, n_steps)``: ``err = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + err * n_steps / horizon``. The clip keeps one noisy batch from moving the coefficient much.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value: float = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by ``1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

        Args:
            current_kl: observed mean KL of the batch.
            n_steps: number of samples in the batch (the horizon is measured in samples).
        """
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (the coefficient evolves, so it must survive a resume)."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient from :meth:`state_dict` (target/horizon come from the current config)."""
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(kl_type: str, kl_coef: float, kl_target: float, kl_horizon: float) -> KLController:
    """Build the controller for ``algorithm.kl_type``.

    Args:
        kl_type: ``fixed`` or ``adaptive``.
        kl_coef: (initial) coefficient.
        kl_target: adaptive only, target KL.
        kl_horizon: adaptive only, horizon in samples.

    Returns:
        A controller with ``.value``, ``.update(current_kl, n_steps)`` and ``state_dict``/``load_state_dict``.
    """
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
    raise ValueError(f"unknown kl_type {kl_type!r}; choose one of fixed, adaptive")


class AdaptiveEntropyController:
    """Adaptive entropy bonus coefficient of Skywork-OR1.

    An internal coefficient ``c`` moves by ``delta`` per :meth:`update`: up when the observed entropy is strictly
    below ``target_entropy``, down otherwise, always clamped to ``[min_coef, max_coef]``.

    :attr:`value` is the coefficient to apply to the entropy bonus on the next actor update: ``c`` if the most
    recent observed entropy was strictly below the target, else 0. So the bonus is active only while entropy is
    too low, and ``c`` remembers how strongly it had to push last time. Before the first ``update`` nothing is
    known about the entropy and ``value`` is 0.
    """

    def __init__(
        self, init_coef: float, target_entropy: float, delta: float, min_coef: float = 0.0, max_coef: float = 1.0
    ) -> None:
        if min_coef > max_coef:
            raise ValueError(f"min_coef ({min_coef}) must not exceed max_coef ({max_coef})")
        if delta < 0:
            raise ValueError(f"delta must be non-negative, got {delta}")
        self.target_entropy = float(target_entropy)
        self.delta = float(delta)
        self.min_coef = float(min_coef)
        self.max_coef = float(max_coef)
        self.coef = min(max(float(init_coef), self.min_coef), self.max_coef)
        self.last_entropy: float | None = None

    def update(self, current_entropy: float) -> None:
        """Record the observed mean token entropy and step the coefficient towards keeping it at the target."""
        current = float(current_entropy)
        step = self.delta if current < self.target_entropy else -self.delta
        self.coef = min(max(self.coef + step, self.min_coef), self.max_coef)
        self.last_entropy = current

    @property
    def value(self) -> float:
        """Coefficient to apply now: ``coef`` while the last entropy is below target, else 0."""
        if self.last_entropy is None or self.last_entropy >= self.target_entropy:
            return 0.0
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.coef = float(state["coef"])
        last = state.get("last_entropy")
        self.last_entropy = None if last is None else float(last)
