"""One GRPO step with audio prompts on a tiny Qwen2.5-Omni thinker (2 FSDP2 workers, the HF engine, packed rows):
the audio tower trains. The parts are tested in tests/models/test_omni.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint
from tests.models.test_omni import audio_data
from tests.trainer.test_e2e import assert_finite, ray_session, run  # noqa: F401  (module-scoped Ray fixture)


@pytest.mark.slow
def test_one_grpo_step_with_audio_trains_the_audio_tower(tmp_path: Path) -> None:
    omni_model = build_tiny_omni_checkpoint(tmp_path / "model")
    data = audio_data(tmp_path / "data")
    # packed rows and the fused-head setting on: the Omni thinker computes its logits through its own forward
    edits = {"data.audio_dir": data["audio_dir"], "data.max_prompt_length": 128,
             "worker.actor.padding_free": True, "worker.actor.fused_logprobs": True}  # fmt: skip
    rows, before, after = run(tmp_path / "run", omni_model, {"train": data["train"]}, edits, steps=1, weights=True)
    assert_finite(rows)
    assert before is not None and after is not None
    audio = [n for n in before if n.startswith("audio_tower.")]
    assert audio, f"no audio-tower parameters in {list(before)[:5]}"
    assert any(not torch.equal(before[n], after[n]) for n in audio), "the audio tower got no gradient: no audio?"
    assert rows[0]["prompt_length/mean"] > 30  # audio tokens expanded into the prompt
