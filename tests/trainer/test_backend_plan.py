"""`trainer.backend` in the run plan: `auto` picks inline exactly when every role is one rank on this node and nothing
needs a process of its own, says why, and an explicit `inline` that cannot be is refused naming the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.check import plan_lines
from easyrl.config import ConfigError, load_config
from easyrl.trainer.plan import Backend, plan_of


DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_auto_is_the_default_and_picks_inline_for_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(DEMO, [])
    assert cfg.trainer.backend == "auto"
    plan = plan_of(cfg)
    assert plan.backend is Backend.INLINE
    assert plan.backend_reason == "auto: one worker per role on this node and nothing needs a process of its own"
    assert "backend: inline, workers in this process (no Ray) (auto: one worker" in "\n".join(plan_lines(cfg))


@pytest.mark.parametrize(
    ("edits", "reason"),
    [
        (["trainer.n_gpus_per_node=2"], "trainer.n_gpus_per_node is 2 (inline runs one worker per role)"),
        (["trainer.nnodes=2"], "trainer.nnodes is 2 (one process cannot span nodes)"),
        (["worker.rollout.name=vllm"], "the vllm engine has not run in the driver's process yet"),
        (
            ["trainer.n_gpus_per_node=2", "worker.rollout.placement=separate", "worker.rollout.n_gpus=1"],
            "worker.rollout.placement is separate (rollout workers of their own)",
        ),
    ],
)
def test_auto_picks_ray_naming_what_needs_it(edits: list[str], reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan = plan_of(load_config(DEMO, ["trainer.backend=auto", *edits]))
    assert plan.backend is Backend.RAY and plan.backend_reason.startswith("auto: ")
    assert reason in plan.backend_reason


def test_sft_has_no_engine_to_rule_inline_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """`easyrl sft` starts no rollout engine: the RL engine's default (vLLM) does not keep it on Ray."""
    from easyrl.config.schema import EasyRLConfig

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = EasyRLConfig()
    cfg.trainer.n_gpus_per_node = 1
    assert cfg.worker.rollout.name == "vllm"
    assert plan_of(cfg, "sft").backend is Backend.INLINE and plan_of(cfg).backend is Backend.RAY


def test_a_cluster_to_join_means_ray_and_an_explicit_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    plan = plan_of(load_config(DEMO, ["trainer.backend=auto"]))
    assert plan.backend is Backend.RAY and "RAY_ADDRESS names a cluster to join" in plan.backend_reason
    monkeypatch.delenv("RAY_ADDRESS")
    plan = plan_of(load_config(DEMO, ["trainer.backend=ray"]))
    assert (plan.backend, plan.backend_reason) == (Backend.RAY, "trainer.backend")


def test_an_inline_that_cannot_be_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"^trainer\.backend: inline runs every role in this process, but trainer\."):
        load_config(DEMO, ["trainer.backend=inline", "trainer.n_gpus_per_node=2"])
    with pytest.raises(
        ConfigError, match=r"trainer\.backend: 'threads' is not allowed; choose one of: auto, ray, inline"
    ):
        load_config(DEMO, ["trainer.backend=threads"])
