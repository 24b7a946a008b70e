"""Calls into an environment other than its tools (`done` as a property, `get_reward`) run under the guard with the
deadline `env_timeout_s`: one that raises or hangs fails its own episode, in bounded time, and the driver waiting on
it still honours SIGTERM at once (issue 45, items 3 and 4)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from easyrl.agent import load_environments
from easyrl.agent.guard import CallGuard
from easyrl.config.multi_turn import MultiTurnConfig


SOURCE = """
import time


class Env:
    def reset(self, mode: str, **row) -> str:
        self.mode = mode
        return "go"

    @property
    def done(self) -> bool:
        if self.mode == "raise":
            raise RuntimeError("the board is gone")
        if self.mode == "hang":
            time.sleep(60)
        return self.mode == "over"

    def get_reward(self) -> float:
        if self.mode == "hang":
            time.sleep(60)
        return {"nan": float("nan"), "text": "much"}.get(self.mode, 1.0)
"""


def _envs(tmp_path: Path, timeout_s: float = 0.3):  # type: ignore[no-untyped-def]
    path = tmp_path / "env.py"
    path.write_text(SOURCE)
    return load_environments(MultiTurnConfig(env=f"{path}:Env", env_timeout_s=timeout_s), lambda row: [])


def test_a_done_property_that_raises_or_hangs_ends_its_episode_with_the_error(tmp_path: Path) -> None:
    envs = _envs(tmp_path)
    assert envs.start({"mode": "over"}).done and not envs.start({"mode": "play"}).done
    raised = envs.start({"mode": "raise"})
    assert raised.done and raised.error == "environment default: reading done failed: RuntimeError: the board is gone"
    hung = envs.start({"mode": "hang"})
    start = time.perf_counter()
    assert hung.done and hung.error == "environment default: reading done failed: did not finish within 0.3s"
    assert time.perf_counter() - start < 2


def test_a_get_reward_that_hangs_or_returns_no_number_is_counted_not_raised(tmp_path: Path) -> None:
    envs = _envs(tmp_path)
    hung = envs.start({"mode": "hang"})
    start = time.perf_counter()
    assert hung.reward() is None and hung.reward_error == "did not finish within 0.3s"
    assert time.perf_counter() - start < 2
    text = envs.start({"mode": "text"})
    assert text.reward() is None and text.reward_error == "ValueError: could not convert string to float: 'much'"
    nan = envs.start({"mode": "nan"})
    assert nan.reward() is None and nan.reward_error == "returned nan: return a finite number"


def test_sigterm_reaches_the_driver_while_it_waits_on_a_hung_call() -> None:
    """The driver waits on a guarded call's event, which a signal interrupts: the run's stop handler runs at once,
    not after the deadline."""

    class Stop(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Stop

    previous = signal.signal(signal.SIGTERM, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.perf_counter()
    try:
        timer.start()
        with pytest.raises(Stop):
            CallGuard(max_hung=1).call("environment hung", lambda: time.sleep(60), {}, 30.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert time.perf_counter() - start < 5
