"""The update levers the memory plan decides (`easyrl.update_levers`, issue 44): gradient checkpointing, the deferred
gradient sync and the forward-only token budget, each at its rule's boundary, as set, and as `easyrl check` prints
them. Their equivalence on real updates is `tests/workers/test_update_levers_equivalence.py`."""

from __future__ import annotations

import copy

from easyrl.check import lever_lines, memory_report
from easyrl.memory_plan import GiB, plan_memory
from easyrl.update_levers import HEADROOM, MAX_LOG_PROB_FACTOR, choose_levers, resolved_config
from tests.test_memory_plan import _config, _shape


def _off(cfg):  # the config with checkpointing off: what the rule plans against
    trial = copy.deepcopy(cfg)
    trial.worker.actor.model.enable_gradient_checkpointing = False
    return trial


def test_checkpointing_off_exactly_when_the_update_without_it_fits_the_headroom() -> None:
    shape, cfg = _shape("1.5b"), _config()
    # with sleep mode the update's figure does not depend on the device's size: the boundary is computable
    needs = plan_memory(shape, _off(cfg), 80 * GiB).updating
    fits = int(needs / HEADROOM) + 1
    levers = choose_levers(cfg, True, 1, shape, fits)
    assert levers.gradient_checkpointing is False
    assert levers.gradient_checkpointing_why.startswith(f"auto: the update without it needs {needs / GiB:.1f} GiB")
    tight = choose_levers(cfg, True, 1, shape, int(needs / HEADROOM) - 1)
    assert tight.gradient_checkpointing is True and tight.gradient_checkpointing_why.endswith("recompute instead")


def test_checkpointing_as_set_cpu_and_unplanned_gpu() -> None:
    shape = _shape("1.5b")
    for value in (True, False):  # EasyR1's keys are obeyed whatever the plan says
        cfg = _config(worker={"actor": {"model": {"enable_gradient_checkpointing": value}}})
        levers = choose_levers(cfg, True, 1, shape, 1000 * GiB if not value else 1 * GiB)
        assert levers.gradient_checkpointing is value and "as set" in levers.gradient_checkpointing_why
    cpu = choose_levers(_config(), False, 2, None, None)
    assert not cpu.gradient_checkpointing and "on CPU" in cpu.gradient_checkpointing_why
    assert not cpu.defer_gradient_sync and "on CPU" in cpu.defer_gradient_sync_why
    assert cpu.log_prob_max_token_len == 16384  # the update's budget
    blind = choose_levers(_config(), True, 8, None, None)  # a GPU run whose GPU the driver cannot see
    assert blind.gradient_checkpointing and not blind.defer_gradient_sync and blind.log_prob_max_token_len == 16384


def test_deferred_sync_needs_ranks_and_room_for_the_unsharded_gradients() -> None:
    shape, cfg = _shape("1.5b"), _config()
    assert not choose_levers(cfg, True, 1, shape, 80 * GiB).defer_gradient_sync  # nothing to reduce on one rank
    eight = choose_levers(cfg, True, 8, shape, 80 * GiB)
    params = shape.parameter_count()
    assert eight.defer_gradient_sync and f"({params * 4 / GiB:.1f} GiB)" in eight.defer_gradient_sync_why
    # the unsharded fp32 gradients are counted in the update
    resolved = resolved_config(cfg, eight)
    with_it = plan_memory(shape, resolved, 80 * GiB)
    assert with_it.actor.accumulated_grads == params * 4
    assert with_it.updating == plan_memory(shape, resolved_config(cfg, eight.__class__(
        **{**eight.__dict__, "defer_gradient_sync": False})), 80 * GiB).updating + params * 4  # fmt: skip
    # 2 GiB of room above the synced update's figure: the 5.7 GiB of unsharded gradients do not fit it
    synced = with_it.updating - params * 4
    assert not choose_levers(cfg, True, 8, shape, int((synced + 2 * GiB) / HEADROOM)).defer_gradient_sync
    explicit = _config(worker={"actor": {"defer_gradient_sync": True}})
    assert choose_levers(explicit, False, 2, None, None).defer_gradient_sync  # as set, even on CPU


def test_forward_only_budget_from_the_update_activations() -> None:
    """1.5B: hidden 1536, 28 layers, q 1536, kv 256, MLP 8960: a layer's working set is 35,072 values a token. With
    checkpointing the update keeps 28 x 1536 + 35,072 bf16 values a token, and the head's gradients (its weight's in
    bf16, 151,936 x 1536 x 2 bytes, and over 16 blocks of columns the hidden states' fp32 sum and a block's bf16
    product, 16384 x 1536 x 6), which a forward-only pass does not build; a forward-only pass
    keeps 1536 + 35,072 a token (the fused head's one chunk cancels out). Without checkpointing 28 x 35,072 / 36,608,
    capped at 8x."""
    shape = _shape("1.5b")
    on = _config(worker={"actor": {"model": {"enable_gradient_checkpointing": True}}})
    levers = choose_levers(on, True, 1, shape, 80 * GiB)
    head_grad = 151936 * 1536 * 2 + 16384 * 1536 * 6
    assert levers.log_prob_max_token_len == (16384 * 78080 * 2 + head_grad) // (36608 * 2) == 43382
    off = _config(worker={"actor": {"model": {"enable_gradient_checkpointing": False}}})
    capped = choose_levers(off, True, 1, shape, 80 * GiB)
    assert (
        capped.log_prob_max_token_len == MAX_LOG_PROB_FACTOR * 16384 and "capped" in capped.log_prob_max_token_len_why
    )
    explicit = _config(worker={"actor": {"log_prob_max_token_len_per_gpu": 5000}})
    assert choose_levers(explicit, True, 1, shape, 80 * GiB).log_prob_max_token_len == 5000
    fixed = _config(worker={"actor": {"dynamic_batching": False}})
    assert choose_levers(fixed, True, 1, shape, 80 * GiB).log_prob_max_token_len is None


def test_resolved_config_keeps_a_critics_own_setting() -> None:
    cfg = _config(worker={"critic": {"model": {"enable_gradient_checkpointing": True}}})
    resolved = resolved_config(cfg, choose_levers(cfg, False, 1, None, None))
    assert resolved.worker.actor.model.enable_gradient_checkpointing is False  # CPU auto
    assert resolved.worker.critic.model.enable_gradient_checkpointing is True
    assert cfg.worker.actor.model.enable_gradient_checkpointing is None  # the config itself is untouched
    follows = resolved_config(_config(), choose_levers(_config(), False, 1, None, None))
    assert follows.worker.critic.model.enable_gradient_checkpointing is False


def test_check_prints_the_levers_and_their_figures() -> None:
    cfg = _config(trainer={"device": "cpu", "n_gpus_per_node": 2})
    assert lever_lines(cfg) == [
        "update lever: gradient checkpointing: off (auto on CPU: no device memory to plan against, and recompute "
        "only costs time)",
        "update lever: deferred gradient sync: off (auto on CPU: gloo runs keep one reduction per micro-batch "
        "(today's summation order))",
        "update lever: log-prob passes' token budget per worker: 16384 (auto without a GPU plan: the update's "
        "worker.actor.max_token_len_per_gpu)",
    ]
    assert lever_lines(cfg, gpu_memory_gib=80) == []  # the memory plan's section prints them instead
    lines, problems = memory_report(_shape("1.5b"), _config(trainer={"n_gpus_per_node": 8}), 80 * GiB)
    assert problems == []
    assert lines[0].startswith("update lever: gradient checkpointing: off (auto: the update without it needs")
    assert lines[1].startswith("update lever: deferred gradient sync: on (auto: the update with the unsharded")
    assert "+ unsharded gradients 5.8 + gathered weights 0.6 = 40.9 GiB" in "\n".join(lines)
