"""`load_tokenizer`: the one way the trainer and `easyrl check` load the tokenizer."""

from __future__ import annotations

from pathlib import Path

from easyrl.models import load_tokenizer
from easyrl.testing.tiny import make_tokenizer


def test_a_text_model_has_no_processor_and_a_pad_token(tmp_path: Path) -> None:
    tok = make_tokenizer()
    tok.pad_token = None  # a tokenizer saved without one pads with its end token
    tok.save_pretrained(tmp_path)
    tokenizer, processor = load_tokenizer(tmp_path)
    assert processor is None
    assert tokenizer.pad_token == tokenizer.eos_token is not None
    assert tokenizer("abc")["input_ids"] == make_tokenizer()("abc")["input_ids"]
