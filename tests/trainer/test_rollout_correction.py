"""The rollout-correction stage of the trainer (`step_math.apply_rollout_correction`, `algorithm.rollout_correction`):
bypass mode, rejection's edit of the loss mask, the `tis_cap` preset; then end to end on CPU (Ray, 2 FSDP2 workers
over gloo, the HF engine, the tiny model and the digits task): bypass mode trains as the recomputed mode when engine
and trainer agree, and each correction trains and logs its metrics. The hand-computed math is
tests/algorithms/test_rollout_correction.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig, RolloutCorrectionConfig, load_config
from easyrl.trainer.plan import effective_logprob_ratio, old_log_prob_pass, plan_of
from easyrl.trainer.role_specs import sampling_params
from easyrl.trainer.step_math import OldPass, apply_rollout_correction, token_level_scores
from tests.conftest import base_config, metric_mismatches, train_steps, write_config


RC = "algorithm.rollout_correction"


def _batch(ratios: list[list[float]], scores: list[float]) -> Batch:
    """Rows of ratios pi_old / pi_rollout (right-padded), the engine's log-probs at -1, each score on the last token."""
    width = max(len(r) for r in ratios)
    mask = torch.zeros(len(ratios), width, dtype=torch.long)
    old = torch.zeros(len(ratios), width)
    for i, row in enumerate(ratios):
        mask[i, : len(row)] = 1
        old[i, : len(row)] = torch.tensor([math.log(r) for r in row]) - 1.0
    rollout = torch.where(mask.bool(), -1.0, 0.0)
    return Batch(
        {
            "loss_mask": mask,
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "token_level_scores": token_level_scores(scores, mask),
        }
    )


def test_bypass_mode_takes_the_engines_log_probs_as_the_old_ones_and_logs_no_self_comparison() -> None:
    batch = _batch([[1.5, 0.5]], [1.0])
    del batch.tensors["old_log_probs"]  # no old-log-prob pass ran
    assert apply_rollout_correction(batch, RolloutCorrectionConfig(bypass_mode=True)) == {}
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert "rollout_is_weights" not in batch


def test_rejection_edits_the_loss_mask_and_moves_each_score_to_the_last_kept_token() -> None:
    batch = _batch([[1.0, 1.2, 4.0], [3.0, 1.0], [1.1, 0.9]], [1.0, 0.5, 0.25])
    cfg = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0)  # band [0.5, 2]
    metrics = apply_rollout_correction(batch, cfg)
    assert batch["loss_mask"].tolist() == [[1, 1, 0], [0, 1, 0], [1, 1, 0]]
    # Row 0 lost its last token, row 1 its first: each score sits on the last token still trained.
    assert batch["token_level_scores"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.25, 0.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 7)
    assert "rollout/logprob_diff_max" in metrics  # the engine-vs-actor diagnostics stay
    assert "rollout_is_weights" not in batch


def test_a_correction_without_the_engines_log_probs_fails_loudly() -> None:
    batch = _batch([[1.0]], [1.0])
    del batch.tensors["rollout_log_probs"]
    with pytest.raises(ValueError, match="rollout_log_probs"):
        apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="token"))
    assert apply_rollout_correction(batch, RolloutCorrectionConfig()) == {}


def _config(tmp_path: Path, model: str, data: dict[str, str], name: str, edits: dict[str, object]) -> EasyRLConfig:
    raw = base_config(model, data, tmp_path / name)
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return load_config(write_config(tmp_path / f"{name}.yaml", raw), [])


def test_tis_cap_is_the_token_tis_preset(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> None:
    preset = _config(tmp_path, tiny_model_dir, digits_data, "preset", {"algorithm.tis_cap": 1.5})
    explicit = _config(
        tmp_path,
        tiny_model_dir,
        digits_data,
        "explicit",
        {f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": 1.5},
    )
    assert preset.algorithm.correction == explicit.algorithm.correction
    for resolve in (old_log_prob_pass, effective_logprob_ratio, plan_of):
        assert resolve(preset) == resolve(explicit), resolve.__name__
    assert sampling_params(preset, plan_of(preset)) == sampling_params(explicit, plan_of(explicit))
    batches = [_batch([[1.0, 1.2, 4.0], [3.0, 0.5]], [1.0, 0.0]) for _ in range(2)]
    metrics = [apply_rollout_correction(b, c.algorithm.correction) for b, c in zip(batches, (preset, explicit))]
    assert metrics[0] == metrics[1]
    assert torch.equal(batches[0]["rollout_is_weights"], batches[1]["rollout_is_weights"])


def test_bypass_mode_skips_the_pass_and_asks_the_engine_for_every_log_prob(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    recomputed = _config(tmp_path, tiny_model_dir, digits_data, "recomputed", {})
    bypass = _config(tmp_path, tiny_model_dir, digits_data, "bypass", {f"{RC}.bypass_mode": True})
    assert old_log_prob_pass(recomputed) is OldPass.ALL_ROWS  # two mini-batches: the second runs moved weights
    assert old_log_prob_pass(bypass) is OldPass.NONE
    assert sampling_params(bypass, plan_of(bypass)).logprobs and effective_logprob_ratio(bypass) == 1.0


# ---------------------------------------------------------------------------------------------- end to end (slow)
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")


@pytest.mark.slow
def test_bypass_mode_trains_as_the_recomputed_mode_when_engine_and_trainer_agree(
    ray_session: None, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """The HF engine in fp32 on CPU with the policy's weights gives the actor's log-probs up to float noise (another
    summation order: ~1e-7): taking them as the old ones (no pass) must train as the pass does."""
    recomputed, _, weights = train_steps(
        tmp_path / "recomputed", tiny_model_dir, digits_data, {}, steps=2, weights=True
    )
    bypass, _, bypass_weights = train_steps(
        tmp_path / "bypass", tiny_model_dir, digits_data, {f"{RC}.bypass_mode": True}, steps=2, weights=True
    )
    assert all("timing_s/old" in row for row in recomputed)
    assert not any("timing_s/old" in row for row in bypass)  # the pass never ran
    # Engine vs actor, and the rollout's entropy: what the actor's pass measures, logged only where it ran; without
    # it the engine figures come from the update's first mini-batch (fewer tokens: other values, the same agreement).
    diagnostics = ("rollout/logprob_diff_", "rollout/token_prob_error", "actor/entropy_rollout")
    assert all(any(k.startswith(diagnostics) for k in row) for row in recomputed)
    assert all(1.0 <= row["rollout/token_prob_error"] < 1 + 1e-5 for row in bypass)
    want = [{k: v for k, v in r.items() if not k.startswith(VOLATILE + diagnostics)} for r in recomputed]
    got = [{k: v for k, v in r.items() if not k.startswith(VOLATILE + diagnostics)} for r in bypass]
    bad = metric_mismatches(got, want)
    assert not bad, "\n".join(bad)
    assert weights is not None and bypass_weights is not None
    for name, tensor in weights.items():
        torch.testing.assert_close(bypass_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


# An engine that samples with the policy's weights rounded to bf16 (as a bf16 engine beside an fp32 trainer): a real
# mismatch on CPU, where the engines run fp32 whatever `worker.rollout.dtype` says. About 1e-3 per token on the tiny
# model, so the bands below are that tight (verl's geo-RS range is 1.0002-1.001).
BF16_ENGINE = """
import torch

from easyrl.rollout import EngineContext, register_engine
from easyrl.rollout.hf import HFRolloutEngine


class Bf16WeightsHFEngine(HFRolloutEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_to_bf16()

    def load_weights(self, weights):
        super().load_weights(weights)
        self.round_to_bf16()

    @torch.no_grad()
    def round_to_bf16(self):
        for param in self._params.values():
            param.copy_(param.to(torch.bfloat16).float())


@register_engine("bf16_weights_hf", override=True)  # override: each run imports this file again
def build(ctx: EngineContext):
    model = ctx.spec.model
    return Bf16WeightsHFEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )
"""

IS_METRICS = (
    "rollout_is_mean",
    "rollout_is_std",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_p50",
    "rollout_is_p90",
    "rollout_is_p99",
    "rollout_is_eff_sample_size",
    "rollout_is_clamped_fraction",
    "rollout_is_masked_fraction",
)
RS_METRICS = (
    "rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction",
    "rollout_is_veto_fraction",
    "rollout_is_catastrophic_token_fraction",
)
# name: (edits, the metric that shows the correction acted: clamped, masked or rejected, in some step)
CORRECTIONS = {
    "token_tis": ({"algorithm.tis_cap": 1.0005}, "rollout_is_clamped_fraction"),
    "icepop": (
        {
            f"{RC}.rollout_is": "token",
            f"{RC}.rollout_is_threshold": 1.0005,
            f"{RC}.rollout_is_threshold_lower": 0.9995,
        },
        "rollout_is_masked_fraction",
    ),
    "geo_rs": (
        {
            f"{RC}.rollout_rs": "geometric",
            f"{RC}.rollout_rs_threshold": 1.0002,
            f"{RC}.rollout_token_veto_threshold": 1e-4,
        },
        "rollout_rs_seq_masked_fraction",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # `extended`: token_tis takes icepop's path through the trainer and the loss (token-level IS weights; clamped
    # instead of zeroed, by apply_rollout_correction). `make test` has that path in the icepop case, the preset in
    # test_tis_cap_is_the_token_tis_preset and the clamp by hand in tests/algorithms/test_rollout_correction.py.
    [pytest.param(n, marks=pytest.mark.extended) if n == "token_tis" else n for n in CORRECTIONS],
)
def test_each_correction_trains_and_logs_its_metrics(
    ray_session: None, tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], name: str
) -> None:
    edits, acted = CORRECTIONS[name]
    engine = tmp_path / "bf16_engine.py"
    engine.write_text(BF16_ENGINE)
    edits = {**edits, "algorithm.user_modules": [str(engine)], "worker.rollout.name": "bf16_weights_hf"}
    rows, before, after = train_steps(tmp_path, tiny_model_dir, digits_data, edits, steps=2, weights=True)
    assert len(rows) == 2
    logged = {"token_tis": IS_METRICS, "icepop": IS_METRICS, "geo_rs": RS_METRICS}[name]
    for row in rows:
        for key in ("kl", "k3_kl", *logged):
            assert math.isfinite(row[f"rollout_corr/{key}"]), (name, key)
        assert row["rollout_corr/k3_kl"] > 0  # the bf16 engine is not the fp32 policy
        assert row["actor/skipped_updates"] == 0 and math.isfinite(row["actor/grad_norm"])
    shares = [row[f"rollout_corr/{acted}"] for row in rows]
    assert max(shares) > 0 and min(shares) < 1, shares  # it acted, and left something to train on
    assert before is not None and after is not None
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
