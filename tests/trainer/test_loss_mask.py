"""`loss_mask` apart from the attention mask: tool output is seen (attended) but never trained on.

A multi-turn row carries tool-output tokens inside its response: `response_mask` keeps them (attention, packing,
lengths), `loss_mask` zeroes them. Every stage that trains or scores (token-level scores, KL in the reward,
advantages, truncated IS weights, the policy and value losses, the micro-batch weights, the metrics) must then give
what it gives on the *compressed* rows, the same per-token numbers with the tool tokens cut out. A reader left on
`response_mask` would let the tool tokens' KL, rewards, whitening statistics or token counts in, and fail here.
"""

from __future__ import annotations

import math

import torch

from easyrl.algorithms import FixedKLController
from easyrl.batch import Batch
from easyrl.config import AlgorithmConfig
from easyrl.trainer.step_math import (
    apply_kl_in_reward,
    apply_rollout_correction,
    compute_advantages,
    data_metrics,
    mean_entropy,
    token_level_scores,
)
from easyrl.workers.actor import policy_objective
from easyrl.workers.batching import make_micro_batches
from easyrl.workers.critic import value_objective
from easyrl.workers.forward_backward import _backward_mini_batch, token_log_probs
from tests.conftest import padded_rows, ppo_kl_loss
from tests.workers.test_packing import tiny_lm


CPU = torch.device("cpu")
PROMPT, RESPONSE = 3, 10
LENGTHS = [10, 6, 9, 4]
"""Valid response tokens per row (right-padded to RESPONSE)."""
TOOL = {0: range(3, 6), 2: range(6, 9)}
"""Tool output per row: row 0 in the middle of its response, row 2 at its very end (cut off mid-tool-call)."""
SCORES = [1.0, 0.0, 0.5, 1.0]
LOSS = ppo_kl_loss()


def _rows() -> Batch:
    """Two groups of two rows; the tool tokens are attended (`response_mask` 1) but masked out of `loss_mask`."""
    rows = padded_rows(PROMPT, LENGTHS, torch.Generator().manual_seed(0), width=RESPONSE)
    for i, span in TOOL.items():
        rows["loss_mask"][i, list(span)] = 0
    return Batch(
        rows,
        {"uid": ["a", "a", "b", "b"]},
    )


def _experience(batch: Batch, lp: torch.Tensor) -> None:
    """Old, reference and rollout log-probs, rollout entropy, critic values: different from the current policy
    everywhere, tool tokens included (the engine gives 0 for tokens it did not sample)."""
    g = torch.Generator().manual_seed(1)
    noise = [0.05 * torch.randn(lp.shape, generator=g) for _ in range(4)]
    valid = batch["response_mask"].float()
    batch.set(
        old_log_probs=(lp + noise[0]) * valid,
        ref_log_probs=(lp + noise[1]) * valid,
        rollout_log_probs=(lp + noise[2]) * batch["loss_mask"],
        entropys=torch.rand(lp.shape, generator=g) * valid,
        values=noise[3] * 10 * valid,
    )


def _compress(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's entries where `keep` (B, R) is true, moved left and right-padded with zeros: (B, max kept)."""
    width = int(keep.sum(1).max())
    rows = [x[i][keep[i]] for i in range(x.shape[0])]
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])


def _compressed(full: Batch) -> Batch:
    """The rows with the tool tokens cut out: both masks are the right-padded run of trained tokens."""
    keep = full["loss_mask"].bool()
    counts = keep.sum(1)
    width = int(counts.max())
    mask = (torch.arange(width)[None] < counts[:, None]).long()
    fields = ("old_log_probs", "ref_log_probs", "rollout_log_probs", "entropys", "values")
    return Batch(
        {
            "prompts": full["prompts"],
            "attention_mask": torch.cat([full["attention_mask"][:, :PROMPT], mask], 1),
            "response_mask": mask,
            "loss_mask": mask.clone(),
            **{k: _compress(full[k], keep) for k in fields},
        },
        {"uid": full["uid"]},
    )


def _step_math(batch: Batch) -> dict[str, float]:
    """The driver's per-step math, in the trainer's order, with reinforce++ (returns and whitening read the mask)."""
    batch.set(token_level_scores=token_level_scores(SCORES, batch["loss_mask"]))
    metrics = apply_rollout_correction(batch, AlgorithmConfig(tis_cap=2.0).correction)
    metrics |= apply_kl_in_reward(batch, FixedKLController(0.3), "low_var_kl")
    compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_plus_plus"))
    metrics |= data_metrics(batch, PROMPT, RESPONSE)
    metrics["entropy"] = mean_entropy(batch)
    # Lengths count every attended response token, tool output too: they differ on purpose.
    return {k: v for k, v in metrics.items() if not k.startswith(("response_length", "prompt_length"))}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def test_tool_output_masked_out_of_the_loss_trains_like_rows_without_it() -> None:
    model = tiny_lm()
    full = _rows()
    with torch.no_grad():
        lp, _ = token_log_probs(model, full, CPU, 1.0, with_entropy=False)
    _experience(full, lp)
    comp = _compressed(full)
    keep = full["loss_mask"].bool()

    # Driver: every trained-on quantity equals the compressed rows', and is 0 on tool tokens.
    full_metrics, comp_metrics = _step_math(full), _step_math(comp)
    assert full_metrics.keys() == comp_metrics.keys() and "critic/advantages/mean" in full_metrics
    for key, value in full_metrics.items():
        assert math.isclose(value, comp_metrics[key], rel_tol=1e-6, abs_tol=1e-6), key
    tool = full["response_mask"].bool() & ~keep
    for name in ("token_level_scores", "token_level_rewards", "advantages", "returns", "rollout_is_weights"):
        torch.testing.assert_close(_compress(full[name], keep), comp[name], atol=1e-6, rtol=0, msg=name)
        assert not full[name][tool].any(), f"{name} is non-zero on tool output"

    # Actor: one row per micro-batch, weighed by its trained tokens, against one pass over the compressed rows.
    def loss_fn(mb: Batch, on_device: Batch) -> object:
        lp_mb, ent = token_log_probs(model, mb, CPU, 1.0, with_entropy=True)
        return policy_objective(on_device, lp_mb, ent, LOSS, "token-mean", 0.01)

    loss, metrics = _backward_mini_batch(make_micro_batches(full, 1), loss_fn, CPU, "token-mean", 1)  # type: ignore[arg-type]
    masked_grads = _grads(model)
    lp_all, ent_all = token_log_probs(model, full, CPU, 1.0, with_entropy=True)
    assert ent_all is not None
    out = policy_objective(comp, _compress(lp_all, keep), _compress(ent_all, keep), LOSS, "token-mean", 0.01)
    out.loss.backward()
    reference = _grads(model)
    assert len(masked_grads) == len(reference) > 0
    for got, want in zip(masked_grads, reference):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert math.isclose(loss, float(out.loss), rel_tol=1e-5)
    for key, value in {**out.terms, **out.token_means}.items():
        assert math.isclose(metrics[key], float(value), rel_tol=1e-5, abs_tol=1e-6), key

    # Critic: the value loss and its metrics over the trained tokens only.
    vpreds = full["values"] + 0.3 * torch.randn(full["values"].shape, generator=torch.Generator().manual_seed(2))
    critic_full = value_objective(full, vpreds, 0.2, "token-mean")
    critic_comp = value_objective(comp, _compress(vpreds, keep), 0.2, "token-mean")
    torch.testing.assert_close(critic_full.loss, critic_comp.loss, atol=1e-6, rtol=0)
    for key, value in critic_full.token_means.items():
        assert math.isclose(float(value), float(critic_comp.token_means[key]), abs_tol=1e-6), key
