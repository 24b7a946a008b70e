"""Flow-GRPO's pure functions against hand-computed numbers: the SDE step, its log-prob, guidance, KL, step masks."""

import math

import pytest
import torch

from easyrl.algorithms.flow_grpo import gaussian_kl, guided_velocity, num_train_steps, sde_step, train_steps_mask


HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def test_sde_step_mean_std_and_log_prob_by_hand() -> None:
    # sigma = 0.5, sigma_next = 0.25, a = 1: s = sqrt(0.5 / 0.5) = 1, dt = -0.25,
    # mean = x * (1 + 1 / 1 * -0.25) + v * (1 + 1 * 0.5 / 1) * -0.25 = 0.75 x - 0.375 v, std = 1 * sqrt(0.25) = 0.5.
    x = torch.tensor([[1.0, 2.0], [0.0, -4.0]])
    v = torch.tensor([[2.0, 0.0], [8.0, 1.0]])
    noise = torch.tensor([[0.0, 2.0], [1.0, -1.0]])
    prev, log_prob, mean, std = sde_step(v, x, 0.5, 0.25, 1.0, noise=noise)
    assert torch.allclose(mean, torch.tensor([[0.0, 1.5], [-3.0, -3.375]]))
    assert torch.allclose(std, torch.tensor(0.5))
    assert torch.allclose(prev, torch.tensor([[0.0, 2.5], [-2.5, -3.875]]))
    # log N(prev; mean, 0.5^2) per element = -noise^2 / 2 - log 0.5 - log sqrt(2 pi), averaged over the row.
    expected = torch.tensor([(0.0 - 2.0) / 2, (-0.5 - 0.5) / 2]) + math.log(2.0) - HALF_LOG_2PI
    assert torch.allclose(log_prob, expected)


def test_sde_step_at_sigma_one_uses_next_sigma_in_the_denominator() -> None:
    # sigma = 1, sigma_next = 0.75, a = 0.5: s = 0.5 * sqrt(1 / (1 - 0.75)) = 1, dt = -0.25,
    # mean = x * (1 + 1 / 2 * -0.25) + v * (1 + 0) * -0.25 = 0.875 x - 0.25 v, std = 0.5.
    x, v = torch.tensor([[8.0]]), torch.tensor([[4.0]])
    _, log_prob, mean, std = sde_step(v, x, 1.0, 0.75, 0.5, noise=torch.zeros(1, 1))
    assert mean.item() == pytest.approx(6.0)
    assert std.item() == pytest.approx(0.5)
    assert log_prob.item() == pytest.approx(math.log(2.0) - HALF_LOG_2PI)
    assert torch.isfinite(log_prob).all()


def test_sde_step_per_sample_sigmas_match_scalar_calls() -> None:
    gen = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(2, 3, 4, 4, generator=gen) for _ in range(3))
    both = sde_step(v, x, torch.tensor([0.9, 0.4]), torch.tensor([0.6, 0.0]), 0.7, noise=noise)
    for row, (s, s_next) in enumerate([(0.9, 0.6), (0.4, 0.0)]):
        one = sde_step(v[row : row + 1], x[row : row + 1], s, s_next, 0.7, noise=noise[row : row + 1])
        for got, want in zip(both, one, strict=True):
            assert torch.allclose(got[row : row + 1], want)


def test_sde_step_tends_to_the_euler_ode_step_as_noise_vanishes() -> None:
    x, v = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5]])
    _, _, mean, std = sde_step(v, x, 0.8, 0.5, 1e-4)
    assert torch.allclose(mean, x + v * (0.5 - 0.8), atol=1e-6)
    assert std.item() == pytest.approx(1e-4 * 2.0 * math.sqrt(0.3))  # a * sqrt(0.8 / 0.2) * sqrt(0.3)


def test_scoring_a_sampled_step_gives_the_sampled_log_prob_and_a_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 2, 2, generator=gen)
    v = torch.randn(3, 4, 2, 2, generator=gen, requires_grad=True)
    prev, log_prob, _, _ = sde_step(v, x, 0.7, 0.5, 0.7, generator=torch.Generator().manual_seed(2))
    _, rescored, _, _ = sde_step(v, x, 0.7, 0.5, 0.7, prev_sample=prev)
    assert torch.equal(rescored, log_prob)
    rescored.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    # A step scored under a different velocity is less likely than under the one that produced it (here: far off).
    _, other, _, _ = sde_step(v.detach() + 3.0, x, 0.7, 0.5, 0.7, prev_sample=prev)
    assert (other < log_prob).all()


def test_sde_step_refuses_zero_noise() -> None:
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(torch.zeros(1, 1), torch.zeros(1, 1), 0.5, 0.25, 0.0)


def test_guided_velocity() -> None:
    cond, uncond = torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])
    assert torch.equal(guided_velocity(cond, uncond, 4.5), torch.tensor([10.0, 1.0]))  # 1 + 4.5 * 2
    assert torch.equal(guided_velocity(cond, uncond, 1.0), cond)


def test_gaussian_kl_by_hand() -> None:
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    std = torch.tensor([0.5, 2.0]).reshape(2, 1)
    # row 0: (1 / (2 * 0.25) + 4 / (2 * 0.25)) / 2 = (2 + 8) / 2 = 5; row 1: identical means -> 0.
    assert torch.allclose(gaussian_kl(mean, ref, std), torch.tensor([5.0, 0.0]))


def test_gaussian_kl_equals_the_log_density_gap_in_expectation() -> None:
    # KL(p || q) = E_p[log p - log q]; with many draws the sampled gap matches the closed form.
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(1, 200000)
    v, v_ref = torch.full((1, 200000), 0.3), torch.full((1, 200000), -0.2)
    prev, log_p, mean, std = sde_step(v, x, 0.6, 0.3, 0.7, generator=gen)
    _, log_q, ref_mean, _ = sde_step(v_ref, x, 0.6, 0.3, 0.7, prev_sample=prev)
    assert (log_p - log_q).item() == pytest.approx(gaussian_kl(mean, ref_mean, std).item(), rel=0.05)


@pytest.mark.parametrize(("steps", "fraction", "count"), [(10, 1.0, 10), (10, 0.7, 7), (10, 0.05, 1), (100, 0.29, 29)])
def test_train_steps_mask_exact_count(steps: int, fraction: float, count: int) -> None:
    assert num_train_steps(steps, fraction) == count
    mask = train_steps_mask(5, steps, fraction, seed=11)
    assert mask.shape == (5, steps)
    assert torch.equal(mask.sum(dim=1), torch.full((5,), float(count)))
    assert set(mask.unique().tolist()) <= {0.0, 1.0}


def test_train_steps_mask_is_seeded_and_varies_per_row() -> None:
    a, b = train_steps_mask(8, 10, 0.5, seed=4), train_steps_mask(8, 10, 0.5, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, train_steps_mask(8, 10, 0.5, seed=5))
    assert len({tuple(row.tolist()) for row in a}) > 1


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_train_steps_mask_refuses_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="train_timestep_fraction"):
        train_steps_mask(2, 10, fraction, seed=0)
