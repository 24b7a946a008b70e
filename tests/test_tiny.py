"""Tests of the tiny test models (`easyrl.testing.tiny`), the digits reward and the committed demo assets."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from easyrl.testing.tiny import (
    ARCHS,
    IM_END,
    PAD_TOKEN,
    build_model,
    build_tiny_checkpoint,
    build_tokenizer,
    make_tokenizer,
)


ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo"

TEXTS = [
    "Hello, world!  x  y\n\tz",
    "Reverse: 3 8 1",
    " leading and trailing ",
    "a<think>b</think> <answer>42</answer>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "ünïcødé 中文",
    "  \n\n  1 2 3 ~`!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/",
]


def _load_reward() -> Any:
    spec = importlib.util.spec_from_file_location("digits_reward", ROOT / "reward_functions" / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(root / arch, arch=arch) for arch in ARCHS}


def test_tokenizer_round_trip() -> None:
    tok = make_tokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("Copy: 1 2")
    assert ids == [ord(c) for c in "Copy: 1 2"]  # one token per ASCII character, id == byte value
    assert tok.encode("<think>") == [tok.convert_tokens_to_ids("<think>")]
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN and tok.padding_side == "left"
    assert tok.decode(tok.encode("<|im_start|>a<think>b<|im_end|>"), skip_special_tokens=True) == "a<think>b"


def test_tokenizer_save_load(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (
        tok.eos_token_id,
        tok.pad_token_id,
        "left",
    )
    assert loaded.chat_template == tok.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


def test_chat_template() -> None:
    tok = make_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Copy: 1 2"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCopy: 1 2<|im_end|>\n<|im_start|>assistant\n"
    )
    multimodal = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tok.apply_chat_template(multimodal, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\n<image>What is it?<|im_end|>\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_model_loads_and_generates(checkpoints: dict[str, str], arch: str) -> None:
    path = checkpoints[arch]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size == 272 and model.config.vocab_size % 16 == 0
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    for text in TEXTS:  # whichever tokenizer class transformers picks for this model type encodes the same
        assert tok.decode(tok.encode(text)) == text
    enc = tok(["Copy: 1", "Reverse: 1 2 3"], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 4


def test_build_model_is_deterministic(tmp_path: Path) -> None:
    a = (Path(build_model(tmp_path / "a", seed=3)) / "model.safetensors").read_bytes()
    b = (Path(build_model(tmp_path / "b", seed=3)) / "model.safetensors").read_bytes()
    c = (Path(build_model(tmp_path / "c", seed=4)) / "model.safetensors").read_bytes()
    assert a == b and a != c


def test_build_model_options(tmp_path: Path) -> None:
    path = build_model(tmp_path, arch="llama", hidden_size=32, num_layers=1, vocab_size=320, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (32, 1, 320)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError):
        build_model(tmp_path / "bad", arch="gpt9")


@pytest.mark.parametrize(
    ("response", "answer", "accuracy", "fmt", "overall"),
    [
        ("183", "183", 1.0, 1.0, 1.0),
        ("18", "183", 2 / 3, 0.5, 0.65),
        ("1834", "183", 0.75, 0.5, 0.725),
        (" 381\n", "183", 1 / 3, 1.0, 0.4),
        ("1 8 3", "183", 0.2, 0.0, 0.18),
        ("abc", "183", 0.0, 0.5, 0.05),
        ("", "183", 0.0, 0.0, 0.0),
    ],
)
def test_digits_reward(response: str, answer: str, accuracy: float, fmt: float, overall: float) -> None:
    reward = _load_reward()
    assert reward.REWARD_TYPE == "batch" and reward.REWARD_NAME == "digits" and reward.main is reward.compute_score
    (score,) = reward.compute_score([{"response": response, "response_length": 3, "ground_truth": answer}])
    assert score == pytest.approx({"overall": overall, "format": fmt, "accuracy": accuracy})
    # all or nothing: 1 only for the answer itself (whitespace around it stripped), the sub-scores unchanged
    (exact,) = reward.compute_score([{"response": response, "ground_truth": answer}], exact_match=True)
    assert exact == pytest.approx({"overall": float(response.strip() == answer), "format": fmt, "accuracy": accuracy})


def test_demo_assets() -> None:
    tok = AutoTokenizer.from_pretrained(DEMO / "model")
    model = AutoModelForCausalLM.from_pretrained(DEMO / "model")
    assert model.config.model_type == "qwen2" and tok.eos_token_id == model.config.eos_token_id
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total < 2 * 1024 * 1024
    rows = {}
    for name, count in (("train", 2000), ("val", 64)):
        lines = (DEMO / f"{name}.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines]
        assert len(rows[name]) == count
    for row in rows["train"] + rows["val"]:
        assert set(row) == {"prompt", "answer"}
        task, digits = row["prompt"].split(": ")
        digits = digits.replace(" ", "")
        assert row["answer"] == (digits[::-1] if task == "Reverse" else digits)
        prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
        assert len(prompt) < 48 and len(tok.encode(row["answer"])) < 12
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["val"]}

    # The warm start: greedy answers are good, responses sampled at temperature 1.0 leave RL clear headroom.
    reward = _load_reward()
    val = rows["val"]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for r in val]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    means = {}
    for mode, kwargs in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "top_k": 0})):
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=16, pad_token_id=tok.pad_token_id, **kwargs)
        responses = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        inputs = [{"response": s, "response_length": 0, "ground_truth": r["answer"]} for s, r in zip(responses, val)]
        means[mode] = sum(s["overall"] for s in reward.compute_score(inputs)) / len(val)
    assert means["greedy"] > 0.75, means
    assert means["sampled"] < 0.5, means
