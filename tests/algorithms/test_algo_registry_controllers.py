"""Registries, entropy/log-prob helpers and the KL / entropy coefficient controllers."""

import math
from dataclasses import dataclass

import pytest
import torch

from easyrl.algorithms import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    get_advantage_estimator,
    get_kl_controller,
    get_policy_loss,
    get_policy_loss_params,
    list_advantage_estimators,
    list_policy_losses,
    logprobs_from_logits,
    logprobs_from_logits_chunked,
    policy_loss_params,
    policy_loss_with_params,
    register_advantage_estimator,
    register_policy_loss,
)
from easyrl.config import ActorConfig


def test_user_registered_estimator_is_selected_by_name() -> None:
    @register_advantage_estimator("test_user_const")
    def const_adv(token_level_rewards, response_mask, index, **kwargs):
        adv = 7.0 * response_mask
        return adv, adv

    assert "test_user_const" in list_advantage_estimators()
    fn = get_advantage_estimator("test_user_const")
    assert fn is const_adv
    adv, _ = fn(token_level_rewards=torch.zeros(1, 2), response_mask=torch.tensor([[1.0, 0.0]]), index=[0], gamma=1.0)
    torch.testing.assert_close(adv, torch.tensor([[7.0, 0.0]]))


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda **kw: kw)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo")(lambda **kw: kw)

    @register_policy_loss("test_user_loss")
    def my_loss(**kwargs):
        return torch.tensor(0.0), {}

    assert "test_user_loss" in list_policy_losses()
    assert get_policy_loss("test_user_loss") is my_loss
    with pytest.raises(ValueError):
        register_policy_loss("test_user_loss")(my_loss)
    # An explicit override is allowed.
    register_policy_loss("test_user_loss", override=True)(my_loss)


def _loss_inputs() -> dict[str, torch.Tensor | str | None]:
    ones = torch.ones(1, 2)
    return {
        "old_log_prob": -ones,
        "log_prob": -ones,
        "advantages": ones,
        "response_mask": ones,
        "loss_agg_mode": "token-mean",
        "rollout_is_weights": None,
    }


def test_a_loss_without_params_gets_no_knobs() -> None:
    seen: dict[str, object] = {}

    @register_policy_loss("test_user_no_knobs")
    def no_knobs(**kwargs):
        seen.update(kwargs)
        return torch.tensor(0.0), {}

    assert get_policy_loss_params("test_user_no_knobs") is None
    assert policy_loss_params("test_user_no_knobs", ActorConfig()) == ()
    policy_loss_with_params("test_user_no_knobs", ())(**_loss_inputs())
    assert set(seen) == set(_loss_inputs())  # the tensors and the aggregation mode, no `params`, no knob


def test_a_loss_gets_its_own_params_filled_by_field_name() -> None:
    @dataclass(frozen=True)
    class GateParams:
        tau_negative: float
        clip_ratio_high: float

    seen: dict[str, object] = {}

    @register_policy_loss("test_user_gate", params=GateParams)
    def gate(*, params: GateParams, **kwargs):
        seen["params"] = params
        return torch.tensor(0.0), {}

    pairs = policy_loss_params("test_user_gate", ActorConfig(tau_negative=2.5, clip_ratio_high=0.4))
    assert pairs == (("tau_negative", 2.5), ("clip_ratio_high", 0.4))
    policy_loss_with_params("test_user_gate", pairs)(**_loss_inputs())
    assert seen["params"] == GateParams(tau_negative=2.5, clip_ratio_high=0.4)


def test_a_params_field_the_config_cannot_fill_is_one_error_at_registration() -> None:
    @dataclass(frozen=True)
    class Typo:
        clip_ratio_low: float
        clip_ratio_hi: float

    with pytest.raises(ValueError) as info:
        register_policy_loss("test_user_typo", params=Typo)(lambda **kw: kw)
    message = str(info.value)
    assert "\n" not in message
    assert "'test_user_typo'" in message and "'clip_ratio_hi'" in message and "'clip_ratio_low'" not in message
    assert "not worker.actor keys" in message and "name each field after the worker.actor key" in message
    assert "test_user_typo" not in list_policy_losses()


def test_params_must_be_frozen_and_knobs_never_arguments() -> None:
    @dataclass
    class Mutable:
        clip_ratio_low: float

    with pytest.raises(TypeError, match=r"'test_user_mutable': params must be a @dataclass\(frozen=True\)"):
        register_policy_loss("test_user_mutable", params=Mutable)
    # an old-style loss that read a knob as a keyword argument would silently keep its default: refused
    with pytest.raises(TypeError, match=r"'test_user_old_style' takes 'clip_ratio_low' as an argument"):

        @register_policy_loss("test_user_old_style")
        def old_style(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=0.2, **kwargs):
            return torch.tensor(0.0), {}

    assert "test_user_old_style" not in list_policy_losses()


def test_unknown_names_list_registered_ones() -> None:
    with pytest.raises(KeyError) as exc:
        get_advantage_estimator("nope")
    message = str(exc.value)
    assert "nope" in message and "grpo" in message and "reinforce_plus_plus_baseline" in message
    with pytest.raises(ValueError, match=r"cispo.*gspo.*ppo"):
        get_policy_loss("nope")


def test_builtin_names() -> None:
    assert {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "gae",
        "grpo_passk",
    } <= set(list_advantage_estimators())
    assert {"ppo", "vanilla", "gspo", "gspo_token", "cispo", "sapo"} <= set(list_policy_losses())


def test_entropy_from_logits() -> None:
    ln3 = math.log(3.0)
    logits = torch.tensor([[[0.0, 0.0, -1e9, -1e9], [0.0, ln3, -1e9, -1e9], [1.0, 1.0, 1.0, 1.0]]])  # (1, 3, 4)
    # uniform over 2 -> ln 2; p = (1/4, 3/4) -> 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616; uniform over 4 -> ln 4
    expected = torch.tensor([[math.log(2.0), 0.5623351, math.log(4.0)]])
    for chunk in (1, 2, 2048):
        out = entropy_from_logits(logits, chunk_size=chunk)
        assert out.shape == (1, 3)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_entropy_gradient_with_checkpointed_chunks() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], requires_grad=True)
    entropy_from_logits(logits, chunk_size=1).sum().backward()
    # dH/dl_j = -p_j (l_j - E_p[l]); E_p[l] = 0.75 ln 3 = 0.8239592.
    # Row 0: -0.25 * (0 - 0.8239592) = 0.2059898 and -0.75 * (1.0986123 - 0.8239592) = -0.2059898. Row 1: 0.
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, torch.tensor([[0.2059898, -0.2059898], [0.0, 0.0]]), atol=1e-6, rtol=0)


def test_logprobs_from_logits() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # (1, 2, 2), p = (0.25, 0.75)
    labels = torch.tensor([[1, 0]])
    expected = torch.tensor([[math.log(0.75), math.log(0.25)]])  # -0.2876821, -1.3862944
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    for chunk in (1, 3):
        torch.testing.assert_close(logprobs_from_logits_chunked(logits, labels, chunk_size=chunk), expected)
    out = logprobs_from_logits_chunked(logits.bfloat16(), labels)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    leaf = logits.clone().requires_grad_(True)
    logprobs_from_logits_chunked(leaf, labels, chunk_size=1).sum().backward()
    # d log p_y / d l_j = 1[j = y] - p_j: label 1 -> (-0.25, 0.25); label 0 -> (0.75, -0.75)
    assert leaf.grad is not None
    torch.testing.assert_close(leaf.grad, torch.tensor([[[-0.25, 0.25], [0.75, -0.75]]]))


def test_fixed_kl_controller() -> None:
    ctrl = get_kl_controller("fixed", kl_coef=0.1, kl_target=0.5, kl_horizon=10)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=5.0, n_steps=1000)
    assert ctrl.value == 0.1
    with pytest.raises(ValueError, match="adaptive"):
        get_kl_controller("pid", 0.1, 0.1, 10)


def test_adaptive_kl_controller() -> None:
    ctrl = get_kl_controller("adaptive", kl_coef=0.1, kl_target=0.1, kl_horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.15, n_steps=10)  # err 0.5 -> clipped 0.2; mult 1 + 0.2 * 10/100 = 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.09, n_steps=10)  # err -0.1; mult 1 - 0.1 * 0.1 = 0.99 -> 0.10098
    assert ctrl.value == pytest.approx(0.10098)
    state = ctrl.state_dict()
    ctrl.update(current_kl=0.0, n_steps=50)  # err -1 -> -0.2; mult 1 - 0.2 * 0.5 = 0.9 -> 0.090882
    assert ctrl.value == pytest.approx(0.090882)
    fresh = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.1, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == pytest.approx(0.10098)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_adaptive_entropy_controller() -> None:
    ctrl = AdaptiveEntropyController(init_coef=0.0, target_entropy=0.2, delta=0.01, min_coef=0.0, max_coef=0.02)
    assert ctrl.value == 0.0  # nothing observed yet
    ctrl.update(0.1)  # below target: coef 0 + 0.01, bonus on
    assert ctrl.value == pytest.approx(0.01)
    ctrl.update(0.1)  # 0.02
    ctrl.update(0.1)  # 0.03 clamped to max 0.02
    assert ctrl.value == pytest.approx(0.02)
    ctrl.update(0.3)  # above target: coef 0.01 but bonus off
    assert ctrl.coef == pytest.approx(0.01) and ctrl.value == 0.0
    state = ctrl.state_dict()
    ctrl.update(0.2)  # at target counts as "not below": coef 0.0, bonus off
    assert ctrl.coef == pytest.approx(0.0) and ctrl.value == 0.0
    ctrl.update(0.3)  # -0.01 clamped to min 0
    assert ctrl.coef == 0.0
    ctrl.update(0.1)
    assert ctrl.value == pytest.approx(0.01)
    restored = AdaptiveEntropyController(init_coef=0.5, target_entropy=0.2, delta=0.01, min_coef=0.0, max_coef=0.02)
    restored.load_state_dict(state)
    assert restored.coef == pytest.approx(0.01) and restored.value == 0.0
    restored.update(0.1)  # 0.01 + 0.01
    assert restored.value == pytest.approx(0.02)
