"""RL with audio prompts on a tiny Qwen2.5-Omni thinker (GRPO) and a tiny Qwen3-Omni MoE thinker (PPO with GAE and a
thinker critic) on 2 FSDP2 workers, the HF engine, packed rows: one step trains the audio tower, a second resumes
from its checkpoint, and the merge gives a folder whose weights and processor load back; LoRA adapts the language
layers alone. The parts are tested in tests/models/test_omni.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easyrl.merge import main as merge_main
from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint
from tests.models.test_omni import audio_data
from tests.trainer.test_e2e import assert_finite, run


pytestmark = pytest.mark.usefixtures("ray_session")  # Ray: tests/conftest.py


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "estimator"), [("qwen2_5_omni", "grpo"), ("qwen3_omni_moe", "gae")])
def test_rl_with_audio_trains_the_audio_tower_resumes_and_merges(tmp_path: Path, variant: str, estimator: str) -> None:
    from transformers import AutoModelForImageTextToText

    from easyrl.models import load_processor

    omni_model = build_tiny_omni_checkpoint(tmp_path / "model", variant=variant)
    data = audio_data(tmp_path / "data")
    # packed rows and the fused head: the thinker's own forward with an identity head, then the chunked head
    edits = {"data.audio_dir": data["audio_dir"], "data.max_prompt_length": 128, "trainer.save_freq": 1,
             "worker.actor.padding_free": True, "worker.actor.fused_logprobs": True, "algorithm.adv_estimator": estimator}  # fmt: skip
    if estimator == "gae":  # the critic is the thinker under a value head (easyrl.models.value.ThinkerValueModel)
        edits |= {"worker.critic.global_batch_size": 2, "worker.critic.micro_batch_size_per_device_for_update": 2}
    rows, before, after = run(tmp_path / "run", omni_model, {"train": data["train"]}, edits, steps=1, weights=True)
    assert_finite(rows)
    if estimator == "gae":
        assert rows[0]["critic/vf_loss"] > 0 and rows[0]["critic/grad_norm"] > 0
    assert before is not None and after is not None
    audio = [n for n in before if n.startswith("audio_tower.")]
    assert audio, f"no audio-tower parameters in {list(before)[:5]}"
    assert any(not torch.equal(before[n], after[n]) for n in audio), "the audio tower got no gradient: no audio?"
    if variant == "qwen3_omni_moe":  # the routed experts train too
        assert any(not torch.equal(before[n], after[n]) for n in before if ".experts." in n)
    assert rows[0]["prompt_length/mean"] > (30 if variant == "qwen2_5_omni" else 20)  # audio tokens in the prompt
    # The same folder and a longer run: it resumes from global_step_1 and trains step 2; the merge is that policy.
    rows, _, resumed = run(tmp_path / "run", omni_model, {"train": data["train"]}, edits, steps=2, weights=True)
    assert [r["step"] for r in rows] == [1, 2] and resumed is not None
    if estimator == "gae":  # the critic resumed too: its values moved with step 1's update
        assert rows[1]["critic/vf_loss"] > 0 and rows[1]["critic/vpred_mean"] != rows[0]["critic/vpred_mean"]
    merged = tmp_path / "merged"
    assert (
        merge_main([str(tmp_path / "run" / "run" / "global_step_2"), "--output", str(merged), "--dtype", "fp32"]) == 0
    )
    loaded = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32)
    state = dict(loaded.named_parameters(remove_duplicate=False))
    assert state.keys() == resumed.keys()
    for name, param in state.items():
        torch.testing.assert_close(param.detach(), resumed[name], rtol=0, atol=0, msg=name)
    assert load_processor(merged).feature_extractor.sampling_rate == 16000


@pytest.mark.slow
def test_lora_on_the_omni_thinker_adapts_its_language_layers_only(tmp_path: Path) -> None:
    """LoRA on the Qwen2.5-Omni thinker (`all-linear`): the adapters go on the language model's linear layers, not
    on the audio tower nor the vision tower (`lora.default_exclude`), so the merged policy after 2 steps (the first
    step's update merged and pushed into the HF engine before the second generates) moves those layers alone; the
    merge of the run's checkpoint is that policy."""
    from transformers import AutoModelForImageTextToText

    omni_model = build_tiny_omni_checkpoint(tmp_path / "model", variant="qwen2_5_omni")
    data = audio_data(tmp_path / "data")
    edits = {"data.audio_dir": data["audio_dir"], "data.max_prompt_length": 128, "trainer.save_freq": 2,
             "worker.actor.padding_free": True, "worker.actor.model.lora.rank": 4,
             "worker.actor.optim.lr": 1e-2}  # fmt: skip
    rows, before, after = run(tmp_path / "run", omni_model, {"train": data["train"]}, edits, steps=2, weights=True)
    assert_finite(rows)
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
    # step 2's engine generated with step 1's merged adapters: its log-probs are the actor's (a stale engine, 1e-2 of
    # learning rate behind, would be far off)
    assert rows[1]["rollout/logprob_diff_max"] < 1e-4, rows[1]["rollout/logprob_diff_max"]
    assert before is not None and after is not None and before.keys() == after.keys()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    language = {n for n in before if n.startswith("model.layers.") and n.endswith("proj.weight")}
    assert moved == language, sorted(moved ^ language)[:6]
    merged = tmp_path / "merged"
    assert (
        merge_main([str(tmp_path / "run" / "run" / "global_step_2"), "--output", str(merged), "--dtype", "fp32"]) == 0
    )
    loaded = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32)
    for name, param in dict(loaded.named_parameters(remove_duplicate=False)).items():
        torch.testing.assert_close(param.detach(), after[name], rtol=0, atol=1e-6, msg=name)
