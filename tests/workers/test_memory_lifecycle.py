"""The memory lifecycle of real workers on CPU (Ray, gloo, the HF engine): what each process hands back, in which
order, and the ledger keys every step logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easyrl.config import load_config_and_secrets
from easyrl.distributed.memory import memory_keys
from tests.conftest import base_config, write_config


pytestmark = pytest.mark.usefixtures("ray_session")  # Ray: tests/conftest.py


def _one_generation(events: list[str]) -> list[str]:
    """The events of the last generation: from the release that opens its wake to the end of the update."""
    start = max(i for i, e in enumerate(events) if e == "release:before_wake" and events[i - 1] != "wake:weights")
    return events[start:]


def test_every_role_hands_back_before_the_engine_wakes(tmp_path: Path, tiny_model_dir, digits_data) -> None:
    from easyrl.trainer.trainer import Trainer

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"] |= {"disable_kl": False, "use_kl_loss": True}  # a reference worker shares the "GPU"
    conf["trainer"]["max_steps"] = 2
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        trainer.fit()
        actor_events = trainer.actor.memory_events()
        ref_events = trainer.ref.memory_events()
    finally:
        trainer.close()
    for events in actor_events:  # every rank, step 2: the policy changed, so the weights are streamed in between
        assert _one_generation(events) == [
            "release:before_wake",
            "wake:weights",
            "release:before_wake",
            "before_wake",
            "wake:kv_cache",
            "after_generate",
            "sleep",
            "release:after_sleep",
            "after_sleep",
            "start:old",
            "end:old",
            "start:update",
            "end:update",
        ]
        # Step 1: the engine loaded the same checkpoint as the policy and wakes whole.
        assert events[:4] == ["release:before_wake", "before_wake", "wake", "after_generate"]
    for events in ref_events:  # the reference hands its forward's blocks back after each pass
        assert events == ["start:ref", "end:ref", "release:after_ref"] * 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    for row in rows:  # on Linux CPU every key of both roles is measured (RSS), every step
        assert sorted(k for k in row if k.startswith("perf/mem/")) == sorted(memory_keys("actor") + memory_keys("ref"))
        assert all(row[k] > 0 for k in memory_keys("actor") + memory_keys("ref"))
