"""Advantage estimators against hand-computed numbers."""

import math

import numpy as np
import pytest
import torch

from easyrl.algorithms import GROUP_ESTIMATORS, get_advantage_estimator, list_advantage_estimators


# Group "a" = rows 0..2 with scores 0, 2, 4 (mean 2, unbiased std sqrt((4 + 0 + 4) / 2) = 2);
# group "b" = row 3 alone with score 0.5. Valid tokens per row: 2, 3, 1, 2.
R = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 2.0], [4.0, 0.0, 0.0], [0.25, 0.25, 0.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
IDX = ["a", "a", "a", "b"]
EPS = 1e-6


def _run(name: str, rewards: torch.Tensor = R, mask: torch.Tensor = M, index=IDX, **extra):
    return get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=index, **extra)


def test_grpo() -> None:
    adv, ret = _run("grpo")
    # (0-2)/2 = -1, (2-2)/2 = 0, (4-2)/2 = 1; lone sample: (0.5 - 0) / (1 + eps).
    expected = torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)
    # The epsilon is really added to the std: 1 / (2 + 1e-6) differs from 0.5 in the 7th digit.
    assert adv[2, 0].item() == pytest.approx(2.0 / (2.0 + EPS), abs=1e-7)


def test_dr_grpo_and_grpo_without_std() -> None:
    adv, ret = _run("dr_grpo")
    # s - mean: -2, 0, 2; the lone sample keeps 0.5 (mean counts as 0).
    expected = torch.tensor([[-2.0, -2.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)
    adv_nostd, _ = _run("grpo", norm_adv_by_std=False)
    torch.testing.assert_close(adv_nostd, expected)
    # dr_grpo ignores a norm_adv_by_std=True passed by the trainer's common kwargs.
    torch.testing.assert_close(_run("dr_grpo", norm_adv_by_std=True)[0], expected)


def test_rloo() -> None:
    adv, ret = _run("rloo")
    # 0 - (2+4)/2 = -3; 2 - (0+4)/2 = 0; 4 - (0+2)/2 = 3; lone sample 0.
    expected = torch.tensor([[-3.0, -3.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk"])
def test_all_equal_rewards_give_zero_not_nan(name: str) -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    mask = torch.ones(3, 2)
    adv, ret = _run(name, rewards, mask, ["p", "p", "p"])
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, torch.zeros(3, 2))


@pytest.mark.parametrize(
    "index",
    [
        ["a", "a", "a", "b"],
        np.array(["a", "a", "a", "b"], dtype=object),
        np.array([7, 7, 7, 9]),
        torch.tensor([7, 7, 7, 9]),
        (("x", 1),) * 3 + (("y", 1),),
    ],
)
def test_index_types(index) -> None:
    torch.testing.assert_close(_run("grpo", index=index)[0], _run("grpo")[0])


def test_index_length_mismatch() -> None:
    with pytest.raises(ValueError, match="index"):
        _run("grpo", index=["a", "a"])


def test_reinforce_plus_plus() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = _run("reinforce_plus_plus", rewards, mask, [0, 1], gamma=0.5)
    # Row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5. Row 1: G1 = 4, G0 = 0.5*4 = 2, pad 0.
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]))
    # Valid G: 1.5, 1, 2, 2, 4 -> mean 10.5/5 = 2.1; deviations -0.6 -1.1 -0.1 -0.1 1.9;
    # squares sum 0.36+1.21+0.01+0.01+3.61 = 5.2; unbiased var 5.2/4 = 1.3; 1/sqrt(1.3) = 0.8770580.
    s = 0.8770580
    expected = torch.tensor([[-0.6 * s, -1.1 * s, -0.1 * s], [-0.1 * s, 1.9 * s, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_reinforce_plus_plus_skips_masked_middle_token() -> None:
    rewards = torch.tensor([[1.0, 5.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    _, ret = _run("reinforce_plus_plus", rewards, mask, [0], gamma=0.5)
    # The reward 5 under the mask is ignored and the chain links t=0 to t=2: G0 = 1 + 0.5*2 = 2.
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0, 2.0]]))


def test_reinforce_plus_plus_baseline() -> None:
    adv, ret = _run("reinforce_plus_plus_baseline")
    # s - mean_g per valid token: row0 -2 (x2), row1 0 (x3), row2 2 (x1), lone row3 keeps 0.5 (x2).
    # 8 values, sum -4 + 0 + 2 + 1 = -1, mean -0.125; deviations -1.875 (x2), 0.125 (x3), 2.125, 0.625 (x2);
    # squares 2*3.515625 + 3*0.015625 + 4.515625 + 2*0.390625 = 12.375; unbiased var 12.375 / 7.
    s = 1.0 / math.sqrt(12.375 / 7.0)
    expected = torch.tensor(
        [[-1.875 * s, -1.875 * s, 0.0], [0.125 * s] * 3, [2.125 * s, 0.0, 0.0], [0.625 * s, 0.625 * s, 0.0]]
    )
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, adv)


def test_remax() -> None:
    rewards = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = _run("remax", rewards, mask, [0, 1], reward_baselines=torch.tensor([1.0, 2.0]))
    # Reward-to-go: row0 [3, 3, 2]; row1 [3, 0, 0(pad)]. Minus baselines 1 and 2 on valid tokens.
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 1.0], [1.0, -2.0, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        _run("remax", rewards, mask, [0, 1])


def test_gae() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5]])
    adv, ret = _run("gae", rewards, torch.ones(1, 3), [0], values=values, gamma=1.0, lam=0.5)
    # t2: delta = 1 + 0 - 0.5 = 0.5, A2 = 0.5
    # t1: delta = 0 + 0.5 - 0.25 = 0.25, A1 = 0.25 + 0.5*0.5 = 0.5
    # t0: delta = 0 + 0.25 - 0.5 = -0.25, A0 = -0.25 + 0.5*0.5 = 0
    # returns = A + V = [0.5, 0.75, 1.0]
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.75, 1.0]]))
    # whiten [0, .5, .5]: mean 1/3, deviations -1/3, 1/6, 1/6, squares sum 1/6, var (1/6)/2 = 1/12 -> * sqrt(12)
    r12 = math.sqrt(12.0)
    torch.testing.assert_close(adv, torch.tensor([[-r12 / 3, r12 / 6, r12 / 6]]), atol=1e-6, rtol=0)


def test_gae_with_gamma_and_masked_middle() -> None:
    rewards = torch.tensor([[0.0, 9.0, 2.0]])
    values = torch.tensor([[1.0, 7.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = _run("gae", rewards, mask, [0], values=values, gamma=0.5, lam=1.0)
    # t2: delta = 2 + 0 - 1 = 1, A2 = 1; t1 is skipped (its R=9, V=7 unused);
    # t0: delta = 0 + 0.5*V2 - V0 = 0.5 - 1 = -0.5, A0 = -0.5 + 0.5*1*A2 = 0. returns = [0+1, 0, 1+1].
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 2.0]]))
    # whiten [0, 1]: mean 0.5, var (0.25+0.25)/1 = 0.5 -> +-0.5/sqrt(0.5) = +-0.7071068
    torch.testing.assert_close(adv, torch.tensor([[-0.7071068, 0.0, 0.7071068]]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="values"):
        _run("gae", rewards, mask, [0])


def test_grpo_passk() -> None:
    rewards = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 2.0], [5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    idx = ["a", "a", "a", "b"]
    adv, ret = _run("grpo_passk", rewards, mask, idx)
    # Group a scores 0, 4, 2: best row1, runner-up 2 -> 4 - 2 = 2; std sqrt((4+4+0)/2) = 2 -> 2/(2+eps) ~ 1.
    # Row 2's reward sits on a masked token but still counts in s_i = sum_t R (it gets 0 advantage anyway).
    # Lone group b: no runner-up -> 0.
    expected = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)
    adv_raw, _ = _run("grpo_passk", rewards, mask, idx, norm_adv_by_std=False)
    torch.testing.assert_close(adv_raw, 2.0 * expected)
    # A tie for the best gives 0 to everyone (best minus second best = 0).
    tie, _ = _run("grpo_passk", torch.tensor([[3.0], [3.0], [1.0]]), torch.ones(3, 1), [0, 0, 0])
    torch.testing.assert_close(tie, torch.zeros(3, 1))


def test_common_extra_kwargs_are_ignored() -> None:
    extra = {
        "gamma": 1.0,
        "lam": 1.0,
        "values": torch.zeros_like(R),
        "reward_baselines": torch.zeros(4),
        "epsilon": EPS,
        "norm_adv_by_std": True,
        "something_new": "x",
    }
    for name in list_advantage_estimators():
        if name.startswith("test_"):
            continue
        adv, ret = _run(name, **extra)
        assert adv.shape == ret.shape == R.shape, name
        assert torch.all(adv[M == 0] == 0), name
        assert not adv.requires_grad


def test_group_estimators_constant() -> None:
    assert set(GROUP_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk"}
    assert set(GROUP_ESTIMATORS) <= set(list_advantage_estimators())
