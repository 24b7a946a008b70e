"""RLDataset: validation with exact per-reason drop counts, prompt rendering, chat templates, length filtering."""

from __future__ import annotations

import dataclasses
import json
import logging
import string
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from easyrl.config.data import DataConfig
from easyrl.data import DataError, RLDataset, collate_prompts


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ChatML special tokens, built locally (nothing downloaded)."""
    chars = sorted(set(string.printable))
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def _cfg(**overrides: Any) -> DataConfig:
    return dataclasses.replace(DataConfig(max_prompt_length=256), **overrides)


def test_renders_chat_template_and_tokenizes(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2", "level": 3}])
    ds = RLDataset(spec, _cfg(), tokenizer)
    assert len(ds) == 1
    item = ds[0]
    assert item["raw_prompt"] == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert item["prompt_ids"] == tokenizer(item["raw_prompt"], add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == item["prompt_ids"][0]  # one token, not characters
    assert item["ground_truth"] == "2"
    assert item["row"] == {"prompt": "1+1?", "answer": "2", "level": 3}
    assert item["index"] == 0
    assert item["images"] == []


def test_format_prompt_with_extra_columns(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("[{{ subject }} L{{ level }}] {{ content }} Box it.\n", encoding="utf-8")
    rows = [{"question": "2*3?", "solution": 6, "subject": "algebra", "level": 2}]
    spec = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _cfg(prompt_key="question", answer_key="solution", format_prompt=str(template))
    item = RLDataset(spec, cfg, tokenizer)[0]
    assert item["raw_prompt"] == "<|im_start|>user\n[algebra L2] 2*3? Box it.<|im_end|>\n<|im_start|>assistant\n"
    assert item["ground_truth"] == 6


def test_template_referencing_missing_column_is_a_bad_row(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ content }} ({{ hint }})", encoding="utf-8")
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1", "hint": "h"}, {"prompt": "b", "answer": "2"}])
    ds = RLDataset(spec, _cfg(format_prompt=str(template)), tokenizer)
    assert len(ds) == 1
    assert ds.drop_counts == {"template_error": 1}


def test_template_cannot_reach_python_internals(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """The classic jinja escape (cycler -> os.system) is refused by the sandbox: the command never runs and the
    error names the template file, instead of the row being dropped as a bad row."""
    marker = tmp_path / "pwned"
    template = tmp_path / "evil.jinja"
    template.write_text(f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}} {{{{ content }}}}")
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1"}])
    with pytest.raises(DataError, match=r"evil\.jinja.*sandbox forbids"):
        RLDataset(spec, _cfg(format_prompt=str(template), on_bad_row="drop"), tokenizer)
    assert not marker.exists(), "the template ran a shell command"


def test_override_chat_template_inline_and_file(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "x"}])
    inline = "{% for m in messages %}U: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    assert RLDataset(spec, _cfg(override_chat_template=inline), tokenizer)[0]["raw_prompt"] == "U: hi\nA:"
    file = tmp_path / "chat.jinja"
    file.write_text(inline.replace("U:", "User:"), encoding="utf-8")
    assert RLDataset(spec, _cfg(override_chat_template=str(file)), tokenizer)[0]["raw_prompt"] == "User: hi\nA:"
    with pytest.raises(DataError, match="neither a jinja template"):
        RLDataset(spec, _cfg(override_chat_template=str(tmp_path / "missing.jinja")), tokenizer)


def test_message_list_prompt_is_the_conversation(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    template = tmp_path / "t.jinja"
    template.write_text("IGNORED {{ content }}", encoding="utf-8")
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": messages, "answer": "4"}])
    item = RLDataset(spec, _cfg(format_prompt=str(template)), tokenizer)[0]
    assert item["raw_prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def _hundred_rows_with_bad_ones(tmp_path: Path) -> tuple[str, dict[int, str]]:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n definitely not an image")
    from PIL import Image

    Image.new("RGB", (8, 8), "blue").save(tmp_path / "ok.png")
    rows: list[dict[str, Any]] = [
        {"prompt": f"question {i} <image>", "answer": str(i), "images": ["ok.png"]} for i in range(100)
    ]
    bad = {
        7: "missing_prompt",
        19: "missing_answer",
        33: "empty_prompt",
        48: "bad_prompt_type",
        52: "bad_answer_type",
        77: "unreadable_image",
        90: "overlong_prompt",
    }
    del rows[7]["prompt"]
    rows[19]["answer"] = None
    rows[33]["prompt"] = "   "
    rows[48]["prompt"] = 12345
    rows[52]["answer"] = True
    rows[77]["images"] = ["ok.png", "broken.png"]
    rows[90]["prompt"] = "x" * 500
    return _jsonl(tmp_path / "mixed.jsonl", rows), bad


def test_bad_rows_dropped_with_exact_counts(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    spec, bad = _hundred_rows_with_bad_ones(tmp_path)
    with caplog.at_level(logging.WARNING, logger="easyrl.data"):
        ds = RLDataset(spec, _cfg(image_dir=str(tmp_path)), tokenizer)
    assert len(ds) == 93
    assert ds.num_rows_read == 100
    assert ds.drop_counts == dict.fromkeys(bad.values(), 1)
    kept_rows = {ds.source_of(i)[1] for i in range(len(ds))}
    assert kept_rows == set(range(100)) - set(bad)
    # One summary record, naming every reason.
    summaries = [r for r in caplog.records if "dropped 7" in r.getMessage()]
    assert len(summaries) == 1
    assert all(reason in summaries[0].getMessage() for reason in bad.values())
    # Images are resolved against image_dir and kept as paths (pixels are not loaded).
    assert ds[0]["images"] == [str(tmp_path / "ok.png")]
    assert ds[0]["row"]["images"] == ["ok.png"]


@pytest.mark.parametrize("reason_row", [7, 52, 77])
def test_on_bad_row_error_names_file_and_row(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, reason_row: int
) -> None:
    spec, bad = _hundred_rows_with_bad_ones(tmp_path)
    rows = [json.loads(line) for line in Path(spec).read_text().splitlines()]
    # Keep only the one bad row under test (plus good ones) so the first error is the one expected.
    only = [row for i, row in enumerate(rows) if i == reason_row or i not in bad]
    spec = _jsonl(tmp_path / "one_bad.jsonl", only)
    with pytest.raises(DataError) as info:
        RLDataset(spec, _cfg(image_dir=str(tmp_path), on_bad_row="error"), tokenizer)
    message = str(info.value)
    position = sum(1 for i in range(reason_row) if i not in bad)  # its row index in the filtered file
    assert f"one_bad.jsonl, row {position}: {bad[reason_row]}" in message
    assert bad[reason_row] in message


def test_overlong_prompts_error_when_not_filtered(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "short", "answer": "1"}, {"prompt": "y" * 300, "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl, row 1: overlong_prompt.*filter_overlong_prompts"):
        RLDataset(spec, _cfg(filter_overlong_prompts=False), tokenizer)
    ds = RLDataset(spec, _cfg(), tokenizer)
    assert ds.drop_counts == {"overlong_prompt": 1}


def test_no_rows_left_says_why(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = _jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(DataError, match=r"no usable rows left out of 2 \(missing_prompt=2\)"):
        RLDataset(spec, _cfg(), tokenizer)


def test_bad_config_values(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError, match="on_bad_row"):
        RLDataset(spec, _cfg(on_bad_row="skip"), tokenizer)
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<|endoftext|>")
    with pytest.raises(DataError, match="no chat template"):
        RLDataset(spec, _cfg(), bare)


def test_csv_and_parquet_sources_with_stats_and_collate(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    rows = [{"prompt": "a" * n, "answer": n} for n in range(1, 21)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    ds = RLDataset(f"{tmp_path / 'd.parquet'},{tmp_path / 'd.csv'}", _cfg(), tokenizer)
    assert len(ds) == 40
    assert ds[0]["ground_truth"] == 1 and ds[20]["ground_truth"] == "1"  # parquet keeps ints, CSV strings
    overhead = len(ds[0]["prompt_ids"]) - 1
    stats = ds.prompt_length_stats()
    assert stats["min"] == overhead + 1 and stats["max"] == overhead + 20
    assert stats["mean"] == pytest.approx(overhead + 10.5)
    assert overhead + 19 <= stats["p95"] <= overhead + 20
    batch = collate_prompts([ds[0], ds[5]], tokenizer.pad_token_id, 256)
    assert batch["input_ids"].shape == (2, overhead + 6)
    assert batch["ground_truth"] == [1, 6]
