"""PPO / GSPO / GSPO-token / CISPO / SAPO losses and the value loss against hand-computed numbers and autograd."""

import ast
import dataclasses
import inspect
import math
import textwrap

import pytest
import torch

from easyrl.algorithms import (
    ClipParams,
    PpoParams,
    SapoParams,
    compute_value_loss,
    get_policy_loss,
    get_policy_loss_params,
)


PPO = PpoParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0)  # ratio range [0.8, 1.28]
CLIP = ClipParams(clip_ratio_low=0.2, clip_ratio_high=0.28)


def _ppo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Valid tokens (A, ratio):
    #   t1 (+1, 1.1): -1.1 vs -1.1            -> -1.1, unclipped
    #   t2 (+1, 1.5): -1.5 vs -1.28           -> -1.28, clipped
    #   t3 (-1, 0.5):  0.5 vs  0.8            ->  0.8, clipped; dual min(0.8, 3) inactive
    #   t4 (-1, 5.0):  5.0 vs  1.28           ->  5.0, then dual min(5, 3) = 3 (dual active, not "clipped")
    #   t5 (+2, 0.5): -1.0 vs -1.6            -> -1.0, unclipped
    # Padding: a huge ratio, and a -inf log-prob, both must be ignored.
    old = torch.full((2, 4), -1.0)
    ratios = torch.tensor([[1.1, 1.5, 0.5, 100.0], [5.0, 0.5, 1.0, 1.0]])
    lp = old + ratios.log()
    lp[1, 3] = float("-inf")
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0], [-1.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    return old, lp.requires_grad_(True), adv, mask


@pytest.mark.parametrize("name", ["ppo", "vanilla"])
def test_ppo_values_metrics_and_grad(name: str) -> None:
    old, lp, adv, mask = _ppo_batch()
    loss, metrics = get_policy_loss(name)(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", params=PPO
    )
    # (-1.1 - 1.28 + 0.8 + 3.0 - 1.0) / 5 = 0.42 / 5
    assert loss.item() == pytest.approx(0.084, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)  # t2, t3
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)  # t4
    # mean(old - lp) = -ln(1.1 * 1.5 * 0.5 * 5 * 0.5) / 5 = -ln(2.0625) / 5
    assert metrics["ppo_kl"] == pytest.approx(-math.log(2.0625) / 5, abs=1e-6)
    # 0-dim detached tensors: the update loop sums them on the device, read once per mini-batch
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # Only unclipped tokens carry gradient: d(-A*r)/dlp = -A*r, / 5 tokens. t1: -1.1/5, t5: -2*0.5/5.
    expected_grad = torch.tensor([[-0.22, 0.0, 0.0, 0.0], [0.0, -0.2, 0.0, 0.0]])
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, expected_grad, atol=1e-6, rtol=0)


def test_ppo_seq_mean_token_mean_and_is_weights() -> None:
    old, lp, adv, mask = _ppo_batch()
    fn = get_policy_loss("ppo")
    loss, _ = fn(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        params=PPO,
    )
    # row0 (-1.1 - 1.28 + 0.8) / 3 = -0.5266667; row1 (3 - 1) / 2 = 1; mean 0.2366667
    assert loss.item() == pytest.approx(0.2366667, abs=1e-6)
    weights = torch.tensor([[0.5, 1.0, 1.0, 1.0], [1.0, 2.0, 1.0, 1.0]])
    loss_w, _ = fn(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, rollout_is_weights=weights, params=PPO
    )
    # (-0.55 - 1.28 + 0.8 + 3.0 - 2.0) / 5 = -0.03 / 5
    assert loss_w.item() == pytest.approx(-0.006, abs=1e-6)


def test_ppo_without_dual_clip_effect_and_bad_dual() -> None:
    old, lp, adv, mask = _ppo_batch()
    fn = get_policy_loss("ppo")
    # A huge dual constant never binds: t4 keeps 5.0 -> (-1.1 - 1.28 + 0.8 + 5.0 - 1.0) / 5 = 2.42 / 5
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        params=PpoParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=1e9),
    )
    assert loss.item() == pytest.approx(0.484, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_dual"):  # the params refuse it before any loss is computed
        fn(
            old_log_prob=old,
            log_prob=lp,
            advantages=adv,
            response_mask=mask,
            params=PpoParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=1.0),
        )


def _gspo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.zeros(2, 3)
    # Row 0: valid log-ratios 0.1, 0.2 -> mean 0.15 -> r0 = e^0.15 = 1.1618342 (inside [0.8, 1.28]); pad 5.0.
    # Row 1: log-ratios -0.3, -0.3, -0.6 -> mean -0.4 -> r1 = e^-0.4 = 0.6703200 (< 0.8).
    lp = torch.tensor([[0.1, 0.2, 5.0], [-0.3, -0.3, -0.6]], requires_grad=True)
    # Different advantages inside row 0 expose the stop-gradient: each token's gradient must follow its own A.
    adv = torch.tensor([[1.0, 3.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return old, lp, adv, mask


def test_gspo_token_token_mean_and_stop_gradient() -> None:
    old, lp, adv, mask = _gspo_batch()
    loss, metrics = get_policy_loss("gspo_token")(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", params=CLIP
    )
    # Row 0 tokens: -A * 1.1618342 = -1.1618342, -3.4855026 (unclipped). Row 1 (A=-1): max(0.67032, 0.8) = 0.8,
    # clipped. (-4 * 1.1618342 + 3 * 0.8) / 5 = (-4.6473368 + 2.4) / 5 = -2.2473368 / 5
    assert loss.item() == pytest.approx(-0.44946736, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    # mean(old - lp) over valid = -(0.1 + 0.2 - 0.3 - 0.3 - 0.6) / 5 = 0.9 / 5
    assert metrics["ppo_kl"] == pytest.approx(0.18, abs=1e-6)
    loss.backward()
    # d r_it / d lp_it' = sg(r0) if t == t' else 0, so grad_t = -A_t * r0 / 5: [-0.2323668, -0.6971005] on row 0;
    # clipped row 1 and the pad get 0. Without the stop-gradient every r_it would depend on the whole row
    # (d r0 / d lp_t = r0 / 2) and both tokens would get -(1 + 3) * r0 / 2 / 5 = -0.4647337 instead.
    r0 = 1.1618342
    assert lp.grad is not None
    expected = torch.tensor([[-r0 / 5, -3 * r0 / 5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=0)


def test_gspo_sequence_ratio_carries_gradient_to_every_token() -> None:
    old, lp, adv, mask = _gspo_batch()
    loss, metrics = get_policy_loss("gspo")(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", params=CLIP
    )
    # Same values as gspo_token (the ratio's value is r_i on every token): -2.2473368 / 5.
    assert loss.item() == pytest.approx(-0.44946736, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 5)
    loss.backward()
    # r0 = exp((lp_0 + lp_1) / 2), d r0 / d lp_t = r0 / 2; row-0 loss -(1 + 3) * r0 / 5, so both tokens get
    # -4 * r0 / 2 / 5 = -0.4647337: the advantages of a sequence are pooled. Clipped row 1 and the pad get 0.
    r0 = 1.1618342
    assert lp.grad is not None
    expected = torch.tensor([[-0.4 * r0, -0.4 * r0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=0)


def test_gspo_seq_mean_token_mean_and_dual_ignored() -> None:
    old, lp, adv, mask = _gspo_batch()
    fn = get_policy_loss("gspo_token")
    loss, _ = fn(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        params=CLIP,
    )
    # row 0: (-1.1618342 - 3.4855026) / 2 = -2.3236684; row 1: 0.8; mean (-2.3236684 + 0.8) / 2
    assert loss.item() == pytest.approx(-0.7618342, abs=1e-6)
    loss.backward()
    r0 = 1.1618342  # grad_t = -A_t * r0, / 2 tokens in row 0, / 2 sequences
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad[0], torch.tensor([-r0 / 4, -3 * r0 / 4, 0.0]), atol=1e-6, rtol=0)
    # Row 1 with a dual constant of 1.1 would be capped at 1.1 * 1 -- GSPO has no dual clip: its params cannot
    # even carry one, so the constant never reaches it.
    assert {f.name for f in dataclasses.fields(get_policy_loss_params("gspo_token"))} == {
        "clip_ratio_low",
        "clip_ratio_high",
    }


def _sapo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Valid tokens (A, ratio): t1 (+1, 1), t2 (-1, 2), t3 (+2, 0.5), t5 (0, 1); t4 is padding (ratio 100).
    old = torch.zeros(1, 5)
    lp = torch.tensor([[0.0, math.log(2.0), math.log(0.5), math.log(100.0), 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])
    return old, lp, adv, mask


def test_sapo_gates_by_advantage_sign() -> None:
    old, lp, adv, mask = _sapo_batch()
    loss, metrics = get_policy_loss("sapo")(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        params=SapoParams(tau_positive=1.0, tau_negative=2.0),
    )
    # gate f(r; tau) = 4 / tau * sigmoid(tau * (r - 1)), L = -A * f:
    #   t1: tau 1, f = 4 * 0.5 = 2                           -> L = -2
    #   t2: tau 2 (A < 0), f = 2 * sigmoid(2) = 1.7615942     -> L = +1.7615942
    #   t3: tau 1, f = 4 * sigmoid(-0.5) = 1.5101627          -> L = -3.0203254
    #   t5: A = 0                                             -> L = 0
    # token-mean over the 4 valid tokens: -3.2587312 / 4
    assert loss.item() == pytest.approx(-0.8146828, abs=1e-6)
    assert metrics["pg_clipfrac"] == 0.0
    assert metrics["pg_clipfrac_lower"] == 0.0
    loss.backward()
    # dL/dlp = -A * 4 s (1 - s) * r / 4 tokens, s = sigmoid(tau (r - 1)):
    #   t1: -1 * 1 * 1 / 4 = -0.25; t2: 8 * 0.8807971 * 0.1192029 / 4 = 0.2099872;
    #   t3: -2 * 4 * 0.3775407 * 0.6224593 * 0.5 / 4 = -0.2350037; padding t4 and A = 0 t5: 0.
    assert lp.grad is not None
    expected = torch.tensor([[-0.25, 0.2099872, -0.2350037, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=0)


def test_sapo_negative_temperature_only_moves_negative_tokens() -> None:
    old, lp, adv, mask = _sapo_batch()
    fn = get_policy_loss("sapo")
    args = {"old_log_prob": old, "log_prob": lp.detach(), "advantages": adv, "response_mask": mask}
    loss_a, _ = fn(**args, loss_agg_mode="seq-mean-token-sum", params=SapoParams(tau_positive=1.0, tau_negative=1.0))
    loss_b, _ = fn(**args, loss_agg_mode="seq-mean-token-sum", params=SapoParams(tau_positive=1.0, tau_negative=2.0))
    # Only t2 (A = -1, r = 2) changes: 4 * sigmoid(1) = 2.9242344 with tau 1 vs 1.7615942 with tau 2.
    assert loss_a.item() - loss_b.item() == pytest.approx(2.9242344 - 1.7615942, abs=1e-6)
    with pytest.raises(ValueError, match="tau"):
        fn(**args, params=SapoParams(tau_positive=0.0, tau_negative=1.05))


def test_cispo_value_and_gradient_through_clipped_tokens() -> None:
    # t0: old -1, lp -1 -> r = 1 (inside), A = +1: loss -1 * 1 * (-1) = 1
    # t1: old 0, lp ln2 -> r = 2 -> w = 1.28, A = +1: loss -1.28 * 0.6931472 = -0.8872284
    # t2: old 0, lp -ln2 -> r = 0.5 -> w = 0.8, A = -1: loss -0.8 * -1 * -0.6931472 = -0.5545177
    old = torch.tensor([[-1.0, 0.0, 0.0]])
    lp = torch.tensor([[-1.0, math.log(2.0), -math.log(2.0)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics = get_policy_loss("cispo")(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=torch.ones(1, 3), params=CLIP
    )
    # (1 - 0.8872284 - 0.5545177) / 3
    assert loss.item() == pytest.approx(-0.1472487, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # The weight is a constant: grad = -w * A / 3 = [-1/3, -1.28/3, 0.8/3]. Clipped tokens keep gradient
    # (PPO would give 0 there); a non-detached weight would give 0 at t0 (-(r*lp + r) = -(-1 + 1)).
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1.28 / 3, 0.8 / 3]]), atol=1e-6, rtol=0)


def test_value_loss() -> None:
    vpreds = torch.tensor([[1.0, 2.0, 0.0, 9.0]], requires_grad=True)
    values = torch.tensor([[0.5, 1.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2, loss_agg_mode="token-mean")
    # t0: clipped pred 0.5 + 0.2 = 0.7: max(0^2, 0.3^2) = 0.09 -> 0.045 (clipped term larger)
    # t1: clipped pred 1.2: max(1^2, 0.2^2) = 1 -> 0.5;  t2: pred 0 = clipped 0: max(1, 1) -> 0.5
    assert loss.item() == pytest.approx(1.045 / 3, abs=1e-6)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["vpred_mean"] == pytest.approx(1.0)  # (1 + 2 + 0) / 3
    loss.backward()
    # t0: the clamp saturates -> 0; t1: (v - R) / 3 = 1/3; t2: (0 - 1) / 3; pad 0.
    assert vpreds.grad is not None
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1 / 3, -1 / 3, 0.0]]), atol=1e-6, rtol=0)


BUILTIN_KNOBS = {
    "ppo": {"clip_ratio_low", "clip_ratio_high", "clip_ratio_dual"},
    "vanilla": {"clip_ratio_low", "clip_ratio_high", "clip_ratio_dual"},
    "gspo": {"clip_ratio_low", "clip_ratio_high"},
    "gspo_token": {"clip_ratio_low", "clip_ratio_high"},
    "cispo": {"clip_ratio_low", "clip_ratio_high"},
    "sapo": {"tau_positive", "tau_negative"},
}


@pytest.mark.parametrize("name", sorted(BUILTIN_KNOBS))
def test_builtin_params_carry_exactly_the_knobs_the_loss_reads(name: str) -> None:
    """The fields of a loss's params class are the `params.<knob>` its own body reads: no knob it ignores."""
    from easyrl.config.names import BUILTIN_POLICY_LOSSES

    assert set(BUILTIN_KNOBS) == set(BUILTIN_POLICY_LOSSES)
    params_cls = get_policy_loss_params(name)
    assert params_cls is not None
    declared = {f.name for f in dataclasses.fields(params_cls)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(get_policy_loss(name))))
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "params"
    }
    assert declared == read == BUILTIN_KNOBS[name]
