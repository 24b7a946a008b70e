"""Audio through the Qwen3-Omni MoE thinker (docs/models.md, Omni), on a tiny random one built locally
(easyrl/testing/tiny_omni.py, ``variant="qwen3_omni_moe"``: 4 experts, 2 per token): its audio token counts (the
encoder cuts the mel frames into 100-frame chunks), padded rows equal to each row alone, and packed rows giving the
padded rows' log-probs and gradients. The data path and refusals shared with Qwen2.5-Omni are in test_omni.py; one
GRPO step is in tests/trainer/test_omni_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from easyrl.config import ConfigError, DataConfig
from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint, write_tone_wav
from tests.models.omni_checks import (
    assert_packed_rows_give_the_padded_log_probs_and_gradients,
    assert_padded_rows_equal_each_alone,
)


@pytest.fixture(scope="module")
def qwen3_omni(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("qwen3_omni") / "model", variant="qwen3_omni_moe")


def test_audio_token_counts_follow_the_chunked_encoder() -> None:
    """Hand-computed: a chunk of f frames gives three stride-2 convs' output; each full 100-frame chunk gives 13."""
    from easyrl.models.family import audio_output_tokens

    for frames, tokens in ((50, 7), (100, 13), (120, 16), (200, 26), (3000, 390)):
        assert int(audio_output_tokens(torch.tensor(frames), "qwen3_omni_moe")) == tokens, frames
    assert int(audio_output_tokens(torch.tensor(200))) == 50  # Qwen2.5-Omni's arithmetic is unchanged


def _rows(folder: Path, rows: list[dict]) -> DataConfig:
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(
        train_files=str(folder / "rows.jsonl"), audio_dir=str(folder), image_dir=str(folder),
        max_prompt_length=256, min_pixels=32 * 32, max_pixels=64 * 64,
    )  # fmt: skip


def test_dataset_expands_each_clip_into_the_encoders_tokens(tmp_path: Path, qwen3_omni: str) -> None:
    """0.5 s (50 mel frames) makes 7 tokens, 1.2 s (120) 16, a clip past the 2 s window (200) 26; the encoded
    prompts are the lengths the overlong filter counts, and the thinker's forward takes them (its audio encoder
    scatters exactly that many features)."""
    from transformers import AutoModelForImageTextToText

    from easyrl.data.dataset import RLDataset
    from easyrl.models import load_processor

    write_tone_wav(tmp_path / "short.wav", 0.5, 8000)
    write_tone_wav(tmp_path / "mid.wav", 1.2, 22050)
    write_tone_wav(tmp_path / "long.wav", 3.0, 44100)
    cfg = _rows(tmp_path, [{"prompt": f"<audio>Tone {c}?", "answer": "1", "audios": [c]}
                           for c in ("short.wav", "mid.wav", "long.wav")])  # fmt: skip
    processor = load_processor(qwen3_omni)
    data = RLDataset(cfg.train_files, cfg, None, processor)
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert [data[i]["prompt_ids"].count(audio_id) for i in range(3)] == [7, 16, 26]
    stats = data.prompt_length_stats()
    assert (stats["min"], stats["max"]) == (len(data[0]["prompt_ids"]), len(data[2]["prompt_ids"]))
    model = AutoModelForImageTextToText.from_pretrained(qwen3_omni, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert_padded_rows_equal_each_alone(model, [data[i] for i in range(3)])


def test_packed_rows_give_the_padded_log_probs_and_gradients(tmp_path: Path, qwen3_omni: str) -> None:
    """Padded against packed rows with audio and an image: log-probs and every gradient, the experts', audio
    tower's and vision tower's included (tests/models/omni_checks.py)."""
    parts = ("audio_tower.", "visual.", "model.layers.0.mlp.experts.")
    assert_packed_rows_give_the_padded_log_probs_and_gradients(qwen3_omni, tmp_path, parts)


def test_the_audio_tower_dummy_call_adds_exactly_zero(qwen3_omni: str) -> None:
    """The call a rank without audio makes when another rank has audio (easyrl.models.vl_tower): Qwen3-Omni's
    tower takes no post-conv lengths; four zero frames run through it and add a zero wired to its output."""
    from transformers import AutoModelForImageTextToText

    from easyrl.models.vl_tower import _dummy_audio_term

    model = AutoModelForImageTextToText.from_pretrained(qwen3_omni, dtype=torch.float32)
    term = _dummy_audio_term(model.audio_tower, torch.zeros(1, 4, 64))
    assert term.shape == () and float(term.detach()) == 0.0 and term.requires_grad


def test_the_vllm_engine_is_refused_for_it(tmp_path: Path, qwen3_omni: str, digits_data: dict[str, str]) -> None:
    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    conf = base_config(qwen3_omni, digits_data, tmp_path / "run")
    conf.setdefault("worker", {}).setdefault("rollout", {})["name"] = "vllm"
    with pytest.raises(ConfigError, match=r"^worker\.rollout\.name: .* is a Qwen3-Omni MoE thinker: vllm"):
        load_config(write_config(tmp_path / "cfg.yaml", conf))


def test_another_audio_window_is_refused(tmp_path: Path, qwen3_omni: str, digits_data: dict[str, str]) -> None:
    """The audio token counts assume 100-frame chunks (n_window 50, as the processor counts): another is one line."""
    import shutil

    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    model = Path(shutil.copytree(qwen3_omni, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config["audio_config"]["n_window"] = 25
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^worker\.actor\.model\.model_path: .* has audio_config\.n_window=25"):
        load_config(write_config(tmp_path / "cfg.yaml", base_config(str(model), digits_data, tmp_path / "run")))
