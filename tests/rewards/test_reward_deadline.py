"""The reward stage of a batch ends by its deadline (`timeout_s`) whatever the number of hung calls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from easyrl.config.worker import RewardConfig
from easyrl.rewards import RewardError, RewardManager


HANG = """
import time
REWARD_TYPE = "{kind}"

def one(x):
    if x["hang"]:
        time.sleep(3600)
    if x.get("raise"):
        raise ValueError("bad")
    return {{"overall": 1.0}}

def main(x):
    return [one(item) for item in x] if REWARD_TYPE == "batch" else one(x)
"""
MARGIN_S = 3.0  # process kills, replacements and a loaded 2-core test machine


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hang")
    out = {}
    for kind in ("sequential", "batch"):
        (folder / f"{kind}.py").write_text(HANG.format(kind=kind))
        out[kind] = f"{folder / kind}.py:main"
    return out


def _batch(samples: int, hung: int, **extra: Any) -> list[dict[str, Any]]:
    """`hung` hanging samples spread evenly over the batch."""
    return [{"i": i, "hang": (i * hung) // samples != ((i + 1) * hung) // samples, **extra} for i in range(samples)]


def _mostly_raising() -> list[dict[str, Any]]:
    """64 samples: one call hangs, 39 raise at once (past a 0.25 error ratio while the hung call still runs)."""
    inputs = _batch(64, 1)
    for item in inputs[1:40]:
        item["raise"] = True
    return inputs


def _timed(manager: RewardManager, inputs: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    start = time.monotonic()
    _, metrics = manager.score(inputs)
    return time.monotonic() - start, metrics


@pytest.mark.parametrize("workers", [2, 0])
def test_48_of_128_hung_end_within_the_timeout(files: dict[str, str], workers: int) -> None:
    # Before: hung calls ran one worker slot each, one after the other: 48 x 3 s / 2 workers = 72 s.
    cfg = RewardConfig(reward_function=files["sequential"], num_workers=workers, timeout_s=3.0, max_concurrency=64)
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))  # workers started before the clock does
        elapsed, metrics = _timed(manager, _batch(128, 48))
        assert elapsed < cfg.timeout_s + MARGIN_S, elapsed
        assert metrics["reward/timeouts"] == 48 and metrics["reward/errors"] == 0
        assert metrics["reward/overall"] == pytest.approx(80 / 128)
        # The hung workers were replaced: the next batch is whole and fast.
        elapsed, metrics = _timed(manager, _batch(128, 0))
        assert elapsed < cfg.timeout_s and metrics["reward/overall"] == 1.0


def test_all_hung_ends_within_the_timeout(files: dict[str, str]) -> None:
    cfg = RewardConfig(reward_function=files["sequential"], num_workers=2, timeout_s=3.0, max_error_ratio=1.0)
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))
        elapsed, metrics = _timed(manager, _batch(128, 128))
    # 128 hung calls but 2 x 32 slots: the 64 queued ones time out at the same deadline, not a second one.
    assert elapsed < cfg.timeout_s + MARGIN_S, elapsed
    assert metrics["reward/timeouts"] == 128


def test_all_hung_raises_within_the_timeout(files: dict[str, str]) -> None:
    cfg = RewardConfig(reward_function=files["sequential"], num_workers=2, timeout_s=3.0)
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"of 128 samples failed .*max_error_ratio=0\.5"):
            manager.score(_batch(128, 128))
        assert time.monotonic() - start < cfg.timeout_s + MARGIN_S


def test_error_ratio_applies_as_soon_as_exceeded(files: dict[str, str]) -> None:
    """Half the batch raises at once while one call hangs: the stage stops without waiting for the hung call."""
    cfg = RewardConfig(reward_function=files["sequential"], num_workers=2, timeout_s=30.0, max_error_ratio=0.25)
    inputs = _mostly_raising()
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))
        start = time.monotonic()
        with pytest.raises(RewardError, match="before scoring stopped early"):
            manager.score(inputs)
        assert time.monotonic() - start < 10.0  # well before the 30 s deadline


def test_a_stage_stopped_early_leaves_no_call_behind_for_the_next(files: dict[str, str]) -> None:
    """The hung call of a stage that stopped early (error ratio) does not hold a worker into the next stage: that
    stage scores its own samples at once, instead of waiting out the deadline for a call of the last one."""
    cfg = RewardConfig(reward_function=files["sequential"], num_workers=2, timeout_s=30.0, max_error_ratio=0.25)
    inputs = _mostly_raising()
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))
        with pytest.raises(RewardError, match="before scoring stopped early"):
            manager.score(inputs)
        elapsed, metrics = _timed(manager, _batch(8, 0))
        assert elapsed < 10.0, elapsed  # not the 30 s deadline
        assert metrics["reward/overall"] == 1.0 and metrics["reward/timeouts"] == 0


def test_batch_function_hangs_cost_at_most_two_deadlines(files: dict[str, str]) -> None:
    cfg = RewardConfig(reward_function=files["batch"], num_workers=2, timeout_s=2.0, max_error_ratio=1.0)
    with RewardManager(cfg) as manager:
        manager.score(_batch(4, 0))
        elapsed, metrics = _timed(manager, _batch(64, 20))
    # Both chunks hang (first deadline), then their 64 samples are retried at once (second deadline).
    assert elapsed < 2 * cfg.timeout_s + MARGIN_S, elapsed
    assert metrics["reward/timeouts"] == 20 and metrics["reward/retried_chunks"] == 2


def test_interrupt_returns_at_once(files: dict[str, str], tmp_path: Path) -> None:
    """A stop request (what the trainer's SIGTERM handler sends) ends an in-process stage at once, without
    raising for the unscored samples."""
    import threading

    cfg = RewardConfig(reward_function=files["sequential"], num_workers=0, timeout_s=600.0)
    with RewardManager(cfg) as manager:
        threading.Timer(1.0, manager.interrupt).start()
        elapsed, metrics = _timed(manager, _batch(16, 16))
    assert elapsed < 3.0, elapsed
    assert metrics["reward/timeouts"] == 0 and metrics["reward/overall"] == 0.0
