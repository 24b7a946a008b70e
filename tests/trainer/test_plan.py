"""The run plan (`easyrl.trainer.plan.plan_of`): what a config decides, read once, on configs that differ where the
plan's fields do (colocated and synchronous, separate engines, a tool episode at one step of staleness, CPU and
CUDA, LoRA adapters, a critic with KL)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from easyrl.config import load_config
from easyrl.rollout import WeightSync
from easyrl.trainer.plan import DEFAULT_LOGPROB_RATIO, Placement, effective_reuse_first_forward, plan_of
from easyrl.trainer.step_math import OldPass
from tests.conftest import REPO


DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_the_demo_is_colocated_synchronous_single_turn_on_cpu() -> None:
    plan = plan_of(load_config(DEMO, []))
    assert plan.placement is Placement.COLOCATED and not plan.separate and plan.own_rollout_workers == 0
    assert (plan.world_size, plan.data_parallel_size, plan.rollout_workers, plan.rollout_engines) == (1, 1, 1, 1)
    assert (plan.staleness, plan.schedule, plan.episode) == (0, "synchronous", "single_turn")
    assert not plan.use_gpu and not plan.padding_free  # CPU: padded rows
    assert plan.weight_sync is WeightSync.FULL and plan.sleep_level == 2
    assert plan.logprob_ratio == DEFAULT_LOGPROB_RATIO
    # KL off, GRPO, one epoch over one mini-batch: only the update's own forward runs
    assert plan.old_log_prob_pass is OldPass.NONE
    assert not (plan.ref_log_probs or plan.ref_worker or plan.critic or plan.teacher_worker)
    assert plan.chunk_tokens == 3  # a quarter of max_response_length 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.staleness = 1  # type: ignore[misc]


def test_separate_engines_span_their_own_workers() -> None:
    cfg = load_config(
        DEMO, ["trainer.n_gpus_per_node=2", "worker.rollout.placement=separate", "worker.rollout.n_gpus=1"]
    )
    plan = plan_of(cfg)
    assert plan.placement is Placement.SEPARATE and plan.separate
    assert (plan.world_size, plan.rollout_workers, plan.own_rollout_workers, plan.rollout_engines) == (2, 1, 1, 1)


def test_a_tool_episode_at_one_step_of_staleness_carries_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the environment's path is read from the working directory
    overrides = ["trainer.max_staleness=1", "worker.rollout.multi_turn.env=envs/calc.py:CalcEnv"]
    plan = plan_of(load_config(DEMO, overrides))
    assert (plan.staleness, plan.schedule, plan.episode) == (1, "carry_over", "tools")
    assert plan.logprob_ratio == 1.0  # asynchronous rows keep every token's behaviour log-prob


def test_cuda_lora_and_a_critic_with_kl() -> None:
    cfg = load_config(
        DEMO,
        [
            "trainer.device=cuda",
            "algorithm.adv_estimator=gae",
            "algorithm.disable_kl=false",
            "worker.critic.global_batch_size=16",
            "worker.actor.ppo_epochs=2",
        ],
    )
    plan = plan_of(cfg)
    assert plan.use_gpu and plan.padding_free  # CUDA: packed rows
    assert plan.critic and plan.needs.needs_critic and plan.ref_log_probs and plan.ref_worker
    # two epochs: the second runs moved weights; KL in the reward reads every row's before the update
    assert plan.old_log_prob_pass is OldPass.ALL_ROWS
    lora = plan_of(load_config(DEMO, ["algorithm.disable_kl=false", "worker.actor.model.lora.rank=8"]))
    assert lora.ref_log_probs and not lora.ref_worker  # the LoRA actor's base serves as the reference
    assert lora.weight_sync is not WeightSync.FULL


def test_mini_batch_1_takes_the_update_s_first_forward_on_gpus_unless_turned_off() -> None:
    """`worker.actor.reuse_first_forward` null: on for GPU runs, off on CPU (recorded CPU figures stay); as set
    otherwise; never on a diffusion run, whose actor has no such path."""
    two_epochs = ["worker.actor.ppo_epochs=2"]
    cases = {
        (): OldPass.ALL_ROWS,
        ("trainer.device=cuda",): OldPass.AFTER_FIRST_MINI_BATCH,
        ("trainer.device=cuda", "worker.actor.reuse_first_forward=false"): OldPass.ALL_ROWS,
        ("worker.actor.reuse_first_forward=true",): OldPass.AFTER_FIRST_MINI_BATCH,
    }
    for overrides, rows in cases.items():
        assert plan_of(load_config(DEMO, [*two_epochs, *overrides])).old_log_prob_pass is rows, overrides
    cuda = load_config(DEMO, [*two_epochs, "trainer.device=cuda"])
    assert effective_reuse_first_forward(cuda, True) == (True, "auto on GPU")
    reuse, why = effective_reuse_first_forward(load_config(DEMO, two_epochs), False)
    assert not reuse and why.startswith("auto on CPU")
    diffusion = load_config(REPO / "configs" / "demo_diffusion.yaml", ["worker.actor.reuse_first_forward=true"])
    assert effective_reuse_first_forward(diffusion, True)[0] is False


def test_easyrl_check_says_where_each_mini_batch_s_old_log_probs_come_from() -> None:
    from easyrl.check import old_log_probs_line

    def line(*overrides: str) -> str:
        cfg = load_config(DEMO, list(overrides))
        return old_log_probs_line(cfg, plan_of(cfg))

    assert line() == "the update's own, detached (1 pass)"
    reused = line("worker.actor.ppo_epochs=2", "trainer.device=cuda")
    assert reused.startswith("mini-batch 1: the update's own first forward, detached; the others: a forward pass")
    assert reused.endswith("(worker.actor.reuse_first_forward: auto on GPU)")
    cpu = line("worker.actor.ppo_epochs=2")
    assert cpu.startswith("a forward pass before the update, every mini-batch (worker.actor.reuse_first_forward off")
    read = line("worker.actor.ppo_epochs=2", "trainer.device=cuda", "algorithm.disable_kl=false")  # KL in the reward
    assert read == "a forward pass before the update, every mini-batch (read before the update, so none reused)"
