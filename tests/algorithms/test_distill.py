"""On-policy distillation's per-token advantage, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from easyrl.algorithms import distill_advantages, topk_forward_kl


# Two rows of three tokens; the second row's last token is padding (the teacher's -inf there must not leak).
STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -2.0, -math.inf]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TASK = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]])


def test_k1_subtracts_the_log_ratio_of_each_sampled_token() -> None:
    # d = student - teacher = [[0.5, -1.0, 0.0], [0.0, -1.0, pad]]; coef 0.5
    adv, penalty = distill_advantages(TASK, STUDENT, TEACHER, MASK, coef=0.5, mode="k1")
    expected_penalty = torch.tensor([[0.5, -1.0, 0.0], [0.0, -1.0, 0.0]])
    expected = torch.tensor([[0.25, 1.0, 0.5], [-1.0, -0.5, 0.0]])  # A - 0.5 * d, 0 on padding
    torch.testing.assert_close(penalty, expected_penalty)
    torch.testing.assert_close(adv, expected)


def test_k3_subtracts_exp_minus_d_plus_d_minus_one() -> None:
    adv, penalty = distill_advantages(TASK, STUDENT, TEACHER, MASK, coef=0.5, mode="k3")
    # exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818; d = 0 gives 0
    k_half, k_minus_one = math.exp(-0.5) - 0.5, math.e - 2.0
    expected_penalty = torch.tensor([[k_half, k_minus_one, 0.0], [0.0, k_minus_one, 0.0]])
    expected = torch.tensor(
        [[0.5 - 0.5 * k_half, 0.5 - 0.5 * k_minus_one, 0.5], [-1.0, -1.0 - 0.5 * k_minus_one, 0.0]]
    )
    torch.testing.assert_close(penalty, expected_penalty)
    torch.testing.assert_close(adv, expected)
    assert (penalty >= 0).all()  # k3 never rewards a token for being likelier under the teacher


def test_without_task_advantage_the_teacher_alone_steers() -> None:
    adv, _ = distill_advantages(torch.zeros_like(TASK), STUDENT, TEACHER, MASK, coef=2.0, mode="k1")
    # the student over-weights token (0, 0) (d = 0.5): pushed down; under-weights (0, 1) and (1, 1): pushed up
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 2.0, 0.0], [0.0, 2.0, 0.0]]))


def test_a_student_equal_to_its_teacher_keeps_its_task_advantage() -> None:
    adv, penalty = distill_advantages(TASK, STUDENT, STUDENT, MASK, coef=5.0, mode="k3")
    assert torch.equal(adv, TASK * MASK) and not penalty.any()


def test_an_unknown_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="k1, k3"):
        distill_advantages(TASK, STUDENT, TEACHER, MASK, coef=1.0, mode="fkl")


def test_topk_forward_kl_is_the_teachers_weighted_log_ratio_over_its_top_k() -> None:
    # One position, k = 2: p_T = (0.5, 0.25), log p_S = (log 0.25, log 0.5).
    # 0.5 * (log 0.5 - log 0.25) + 0.25 * (log 0.25 - log 0.5) = 0.25 * log 2
    teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
    student = torch.log(torch.tensor([[[0.25, 0.5]]])).requires_grad_()
    fkl = topk_forward_kl(student, teacher)
    torch.testing.assert_close(fkl, torch.tensor([[0.25 * math.log(2.0)]]))
    fkl.sum().backward()
    # d/d log p_S(j) = -p_T(j): the student's log-prob at each of the teacher's tokens is pulled up by its weight.
    torch.testing.assert_close(student.grad, torch.tensor([[[-0.5, -0.25]]]))
    equal = topk_forward_kl(teacher, teacher)  # the student is the teacher: no divergence
    torch.testing.assert_close(equal, torch.zeros(1, 1))
