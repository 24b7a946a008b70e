"""Rows that can never fit `data.max_prompt_length` are dropped before they are tokenized, by a proven bound."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from easyrl.config.data import DataConfig
from easyrl.data import DataError, RLDataset
from easyrl.data.length_bound import overlong_checker
from easyrl.testing.tiny import make_tokenizer
from tests.conftest import REPO
from tests.data.test_data_dataset import tokenizer as char_tokenizer  # noqa: F401  (a WordLevel fixture)


class Recording:
    """The real tokenizer, recording the length of every text it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.seen: list[int] = []

    def __call__(self, texts: list[str], **kwargs: Any) -> Any:
        self.seen.extend(len(t) for t in texts)
        return self._tokenizer(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _data(tmp_path: Path, huge_chars: int) -> str:
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    rows.insert(1, {"prompt": "x" * huge_chars, "answer": "1"})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ten_megabyte_row_is_dropped_without_being_tokenized(tmp_path: Path) -> None:
    tok = Recording(make_tokenizer())
    spec = _data(tmp_path, 10 * 2**20)
    ds = RLDataset(spec, DataConfig(max_prompt_length=64), tok)
    assert len(ds) == 3 and ds.drop_counts == {"overlong_prompt": 1}
    assert tok.seen and max(tok.seen) < 1000, "the 10 MB row reached the tokenizer"
    with pytest.raises(DataError, match=r"row 1: overlong_prompt: prompt has at least \d+ tokens.*not tokenized"):
        RLDataset(spec, DataConfig(max_prompt_length=64, filter_overlong_prompts=False), tok)
    assert max(tok.seen) < 1000


def _texts(rng: random.Random) -> list[str]:
    jamo = "".join(chr(c) for c in (0x1100, 0x1161, 0x11A8))  # three jamo that NFC composes into one syllable
    pieces = ["a", " ", "hello world ", "é", "e\u0301", jamo, "\U0001d400", "😀", "\n", "<|im_start|>", "数学"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 400))) for _ in range(300)]


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_bound_never_exceeds_the_real_token_count(which: str) -> None:
    tok = make_tokenizer() if which == "tiny" else AutoTokenizer.from_pretrained(REPO / "assets" / "demo" / "model")
    check = overlong_checker(tok)
    assert check is not None
    proven = 0
    for text in _texts(random.Random(0)):
        real = len(tok(text, add_special_tokens=False)["input_ids"])
        for limit in (1, 4, 16, 64):
            least = check(text, limit)
            if least is not None:
                proven += 1
                assert real >= least > limit, (text, real, least, limit)
    assert proven > 100  # the bound does decide many rows


def test_no_bound_where_none_is_proven(char_tokenizer) -> None:  # noqa: F811
    """A WordLevel tokenizer may fold a long word into one unknown token: such rows are tokenized in full."""
    assert overlong_checker(char_tokenizer) is None
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    word = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    assert len(word("b" * 10_000)["input_ids"]) == 1  # why no bytes-based bound can hold for it
    assert overlong_checker(word) is None
