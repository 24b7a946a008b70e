"""Audio through the Omni thinker (docs/models.md, Omni), on a tiny random Qwen2.5-Omni thinker built locally
(easyrl/testing/tiny_omni.py) and wav files written here at other sampling rates: decoded and resampled to the
feature extractor's 16 kHz, expanded into as many ``<|AUDIO|>`` tokens as the audio encoder makes, the positions,
forward and generation taking them, packed rows giving the padded rows' log-probs and gradients, and the paths not
built for it refused with one line. One GRPO step is in tests/trainer/test_omni_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pytest import MonkeyPatch

from easyrl.config import ConfigError, DataConfig
from easyrl.testing.tiny_omni import build_tiny_omni_checkpoint, write_tone_wav
from tests.models.omni_checks import (
    assert_packed_rows_give_the_padded_log_probs_and_gradients,
    assert_padded_rows_equal_each_alone,
)


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "model")


def audio_data(folder: Path, rows: int = 8) -> dict[str, str]:
    """`rows` prompts, each with one clip of its own length and rate named relative to the audio folder, but every
    fourth text only (ranks whose micro-batches have no audio still run the audio tower: easyrl.models.vl_tower)."""
    audio = folder / "audio"
    audio.mkdir(parents=True)
    lines = []
    for i in range(rows):
        row = {"prompt": f"How many digits are in {i}{i}?", "answer": str(len(f"{i}{i}"))}
        if i % 4 != 3:
            name = f"clip{i}.wav"
            write_tone_wav(audio / name, 0.3 + 0.1 * (i % 4), (8000, 22050, 44100)[i % 3], tone=200.0 + 50 * i)
            row |= {"prompt": "<audio>" + row["prompt"], "audios": [name]}
        lines.append(row)
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return {"train": str(train), "audio_dir": str(audio)}


def test_audio_is_resampled_to_the_feature_extractors_rate(tmp_path: Path) -> None:
    from easyrl.data.audio import load_audio

    for rate, channels in ((8000, 1), (44100, 2)):
        clip = load_audio(str(write_tone_wav(tmp_path / f"{rate}.wav", 0.5, rate, channels=channels)), 16000)
        assert abs(clip.size - 8000) <= 32, clip.size  # half a second at 16 kHz (the resampler's edge aside)
        spectrum = np.abs(np.fft.rfft(clip))
        assert abs(np.argmax(spectrum) * 16000 / clip.size - 440) < 5  # the tone survives at its pitch
        assert clip.dtype == np.float32 and np.abs(clip).max() < 0.35


def test_bad_audio_is_one_line_naming_the_file(tmp_path: Path) -> None:
    from easyrl.data.audio import AudioError, load_audio

    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    with pytest.raises(AudioError, match=r"audio not decodable \(.*bad\.wav\)"):
        load_audio(str(bad), 16000)


def test_dataset_expands_each_clip_into_the_encoders_tokens(tmp_path: Path, omni_model: str) -> None:
    """A full window (2 s: 200 mel frames) makes 50 tokens; 0.5 s makes 12, as the processor's arithmetic says; the
    counts the overlong filter uses are the ones the encoded prompt has."""
    from easyrl.data.dataset import RLDataset
    from easyrl.models import load_processor

    write_tone_wav(tmp_path / "short.wav", 0.5, 8000)
    write_tone_wav(tmp_path / "long.wav", 3.0, 44100)  # past the 2 s window: cut there
    rows = [{"prompt": "<audio>Tone?", "answer": "1", "audios": ["short.wav"]},
            {"prompt": "Tone?", "answer": "1", "audios": "long.wav"},  # no placeholder: before the text
            {"prompt": "Tone?", "answer": "1", "audios": ["missing.wav"]}]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=str(tmp_path / "rows.jsonl"), audio_dir=str(tmp_path), max_prompt_length=256)
    processor = load_processor(omni_model)
    data = RLDataset(cfg.train_files, cfg, None, processor)
    assert len(data) == 2 and data.drop_counts["unreadable_audio"] == 1
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    for i, tokens in ((0, 12), (1, 50)):
        item = data[i]
        assert item["prompt_ids"].count(audio_id) == tokens
        mm = item["multi_modal_inputs"]
        assert mm["input_features"].shape == (1, 16, 200) and mm["feature_attention_mask"].shape == (1, 200)
        assert len(item["prompt_ids"]) == data.prompt_length_stats()["min" if i == 0 else "max"]
    assert data.media_per_row() == {"image": 0, "video": 0, "audio": 1}


def test_audio_on_a_vision_language_model_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from easyrl.data.dataset import RLDataset
    from easyrl.models import load_processor
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    write_tone_wav(tmp_path / "a.wav", 0.5, 16000)
    rows = [{"prompt": "Tone?", "answer": "1", "audios": ["a.wav"]}, {"prompt": "Text only", "answer": "1"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=str(tmp_path / "rows.jsonl"), audio_dir=str(tmp_path))
    vl = load_processor(build_tiny_vl_checkpoint(tmp_path / "vl", arch="qwen2_5_vl"))
    with caplog.at_level("WARNING"):
        data = RLDataset(cfg.train_files, cfg, None, vl)
    assert len(data) == 1 and data.drop_counts == {"bad_media": 1}
    assert (
        "the row has 1 audio clips but the model's processor (qwen2_5_vl) takes images and videos only" in caplog.text
    )


def test_forward_positions_and_generation_take_the_audio(tmp_path: Path, omni_model: str) -> None:
    """Left-padded rows of different audio lengths: the logits of each row equal its own unpadded forward, and the
    HF engine's generation never samples an audio special token."""
    from transformers import AutoModelForImageTextToText

    from easyrl.data.dataset import RLDataset
    from easyrl.models import generate_with_media, load_processor

    data = audio_data(tmp_path, rows=2)  # two clips of different lengths
    cfg = DataConfig(train_files=data["train"], audio_dir=data["audio_dir"], max_prompt_length=256)
    dataset = RLDataset(cfg.train_files, cfg, None, load_processor(omni_model))
    items = [dataset[0], dataset[1]]
    model = AutoModelForImageTextToText.from_pretrained(omni_model, dtype=torch.float32).eval()
    batch = assert_padded_rows_equal_each_alone(model, items)
    ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
    out = generate_with_media(model, ids, mask, batch["multi_modal_inputs"], max_new_tokens=6, do_sample=True)
    audio_ids = {model.config.audio_token_id, model.config.audio_start_token_id, model.config.audio_end_token_id}
    assert not audio_ids & set(out[:, width:].flatten().tolist())


def test_vllm_is_refused_for_the_omni_thinker_and_sequence_parallelism_with_a_critic_loads(
    tmp_path: Path, omni_model: str, digits_data: dict[str, str]
) -> None:
    """vLLM is the one path not built for the thinker (one line naming the key); Ulysses on the actor and on a `gae`
    critic is (tests/workers/test_ulysses_vl.py)."""
    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    conf = base_config(omni_model, digits_data, tmp_path / "run")
    conf["worker"]["rollout"]["name"] = "vllm"
    with pytest.raises(ConfigError, match=r"^worker\.rollout\.name: .* is a Qwen2\.5-Omni thinker: vllm is not wired"):
        load_config(write_config(tmp_path / "cfg.yaml", conf))
    conf["worker"]["rollout"]["name"] = "hf"
    conf["algorithm"] = {"adv_estimator": "gae"}
    for role in ("actor", "critic"):
        conf["worker"].setdefault(role, {})["ulysses_size"] = 2
    conf["worker"]["actor"]["padding_free"] = True
    conf["worker"]["critic"] |= {"global_batch_size": 2, "micro_batch_size_per_device_for_update": 2}
    cfg = load_config(write_config(tmp_path / "sp.yaml", conf))
    assert cfg.worker.actor.ulysses_size == cfg.worker.critic.ulysses_size == 2


def test_packed_rows_give_the_padded_log_probs_and_gradients(tmp_path: Path, omni_model: str) -> None:
    """Padded against packed rows with audio and an image: log-probs and every gradient, the audio tower's and the
    vision tower's included (tests/models/omni_checks.py)."""
    assert_packed_rows_give_the_padded_log_probs_and_gradients(omni_model, tmp_path, ("audio_tower.", "visual."))


def test_the_audio_tower_is_kept_in_step_without_audio(omni_model: str) -> None:
    """A micro-batch without audio still gives every audio-tower parameter a (zero) gradient, and the dummy call a
    rank makes when another rank has audio runs the tower on four zero frames and adds exactly zero."""
    from transformers import AutoModelForImageTextToText

    from easyrl.models.vl_tower import _dummy_audio_term, keep_vision_tower_in_step

    model = AutoModelForImageTextToText.from_pretrained(omni_model, dtype=torch.float32)
    keep_vision_tower_in_step(model)
    ids = torch.tensor([[40, 41, 42, 43]])
    model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    audio = {n: p.grad for n, p in model.named_parameters() if n.startswith("audio_tower.") and p.requires_grad}
    assert audio and all(g is not None for n, g in audio.items() if "audio_bos_eos" not in n)
    assert all(float(g.abs().sum()) == 0 for g in audio.values() if g is not None)
    like = torch.zeros(1, 4, 64)
    term = _dummy_audio_term(model.audio_tower, like)
    assert term.shape == () and float(term.detach()) == 0.0 and term.requires_grad


RECIPE = Path(__file__).resolve().parents[2] / "configs" / "omni" / "audio_grpo_qwen2_5_omni_7b.yaml"


def _recipe_data(folder: Path) -> list[str]:
    """Rows in the recipe's columns (`problem`, `answer`, `audios`) and its overrides to them."""
    audio = folder / "audio"
    audio.mkdir(parents=True)
    rows = []
    for i in range(128):  # the recipe's rollout_batch_size
        if i < 4:
            write_tone_wav(audio / f"q{i}.wav", 0.5 + 0.25 * i, (8000, 16000, 44100)[i % 3])
        rows.append({"problem": f"<audio>What is {i} + 1?", "answer": str(i + 1), "audios": [f"q{i % 4}.wav"]})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.train_files={folder / 'train.jsonl'}", f"data.val_files={folder / 'train.jsonl'}",
            f"data.audio_dir={audio}"]  # fmt: skip


def test_recipe_passes_check_on_a_tiny_stand_in(tmp_path: Path, omni_model: str, monkeypatch: MonkeyPatch) -> None:
    """configs/omni: `easyrl check` loads the audio rows through the thinker's processor, counts their tokens and
    scores the first; the plan names the HF engine."""
    import io
    from contextlib import redirect_stdout

    from easyrl.check import run_check
    from easyrl.config import load_config

    monkeypatch.chdir(RECIPE.parents[2])
    cfg = load_config(RECIPE, [f"worker.actor.model.model_path={omni_model}", *_recipe_data(tmp_path / "data")])
    out = io.StringIO()
    with redirect_stdout(out):
        code = run_check(cfg)
    text = out.getvalue()
    assert code == 0, text[-3000:]
    assert "train: 128 usable rows" in text and "audio_clips=128" in text
    assert "media_tokens_min=12" in text  # the 0.5 s clip: 12 audio tokens counted into the prompt's length
    assert "<audio>What is 0 + 1?" in text  # the first prompt, rendered (its clip expanded when encoded)
    assert "rollout: 8 hf engine(s)" in text


def test_recipe_plan_on_the_published_thinker_fits_80_gib(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """The published Qwen2.5-Omni-7B thinker's shape (transformers' default thinker config but for the vision
    tower's width, 1280 as in the hub's config.json); its folder with only config.json gives `easyrl check
    --gpu-memory 80`'s plan, the audio encoder counted and the fused head's one (chunk, V) block in the
    activations."""
    import io
    from contextlib import redirect_stdout

    from transformers import Qwen2_5OmniThinkerConfig

    from easyrl.check import print_memory_plan
    from easyrl.config import load_config

    monkeypatch.chdir(RECIPE.parents[2])
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584}
    Qwen2_5OmniThinkerConfig(vision_config=vision).save_pretrained(tmp_path / "thinker")
    overrides = [f"worker.actor.model.model_path={tmp_path / 'thinker'}", *_recipe_data(tmp_path / "data")]
    cfg = load_config(RECIPE, overrides)
    out = io.StringIO()
    with redirect_stdout(out):
        code = print_memory_plan(cfg, gpu_memory_gib=80)
    text = out.getvalue()
    assert code == 0, text
    assert "model: 8.93B parameters" in text, text
    # checkpointed layers, one (1024, 152064) fp32 block of the fused head, the head's bf16 weight gradient
    # 152064 x 3584 x 2 and its fp32 (T, H) sum over blocks
    assert "activations 7.9 (16384 tokens per micro-batch)" in text
    # and FSDP2's bf16 gathered copies at the head's backward: the untied embedding and head, two layers
    assert "gathered weights 3.0 = 27.5 GiB" in text
    # the HF engine: its bf16 weights, and while it generates one call's KV cache: 128 prompts x 8 samples over 8
    # engines, each row at 2048 + 1024 tokens, 2 x 28 layers x 4 KV heads x 128 x 2 bytes a token
    assert "weights 16.6 + one call's 128 rows at full length, 393216 tokens" in text
    assert "while generating: 53.9 of 80.0 GiB" in text and "while updating: 47.7 of 80.0 GiB" in text


def test_a_missing_audio_folder_is_one_line(tmp_path: Path, omni_model: str, digits_data: dict[str, str]) -> None:
    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    conf = base_config(omni_model, digits_data, tmp_path / "run")
    conf["data"]["audio_dir"] = str(tmp_path / "no_such_folder")
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path / "cfg.yaml", conf))
    assert str(err.value).startswith("data.audio_dir: folder not found")
