"""Pure per-step functions of the trainer."""

from __future__ import annotations

import pytest

from easyrl.trainer.step_math import pool_reward_metrics


def test_pooled_reward_metrics_weigh_means_and_sum_counters() -> None:
    first = {"reward/overall": 1.0, "reward/accuracy": 0.5, "reward/errors": 1.0, "reward/timeouts": 0.0}
    second = {"reward/overall": 0.0, "reward/errors": 2.0, "reward/timeouts": 1.0, "reward/format": 1.0}
    pooled = pool_reward_metrics([(first, 6), (second, 2)])
    assert pooled["reward/overall"] == pytest.approx(6 / 8)  # as if the 8 samples were scored at once
    assert pooled["reward/accuracy"] == 0.5  # only the samples that report it
    assert pooled["reward/format"] == 1.0
    assert pooled["reward/errors"] == 3.0 and pooled["reward/timeouts"] == 1.0
    assert pool_reward_metrics([]) == {}
    assert pool_reward_metrics([(first, 4)]) == first
