"""SFT conversations (`easyrl.data.sft`, `easyrl.data.chat_spans`): the trained tokens are the assistant's, as the
chat template renders them, in every turn; template flags and tools reach the template; a template that cannot mark
the assistant's tokens, a row without an answer and an overlong row each stop (or are counted) with one line naming
the file, row and key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.config import DataConfig
from easyrl.config.sft import SFTConfig
from easyrl.data.loading import DataError
from easyrl.data.sft import SFTDataset, collate_sft
from easyrl.testing.tiny import CHAT_TEMPLATE, make_tokenizer


TOK = make_tokenizer()  # one token per character; <|im_start|> 257, <|im_end|> 258 (EOS)
EOS = 258


def _data(tmp_path: Path, rows: list[dict[str, Any]], name: str = "rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _load(tmp_path: Path, rows: list[dict[str, Any]], **cfg: Any) -> SFTDataset:
    data = DataConfig(**{k: v for k, v in cfg.items() if k in DataConfig.__dataclass_fields__})
    sft = SFTConfig(**{k: v for k, v in cfg.items() if k in SFTConfig.__dataclass_fields__})
    return SFTDataset(_data(tmp_path, rows), data, sft, TOK)


def _trained(ds: SFTDataset, i: int) -> list[str]:
    """The trained spans of sample `i`, decoded, in order."""
    item = ds[i]
    ids, mask = item["prompt_ids"] + item["response_ids"], [0] * len(item["prompt_ids"]) + item["loss_mask"]
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(TOK.decode(cur))
            cur = []
    return spans + ([TOK.decode(cur)] if cur else [])


def _chat(*turns: str, system: str | None = None) -> list[dict[str, str]]:
    roles = ["user", "assistant"] * len(turns)
    msgs = [{"role": r, "content": c} for r, c in zip(roles, turns)]
    return ([{"role": "system", "content": system}] if system else []) + msgs


def test_single_turn_trains_the_answer_and_its_eos_only(tmp_path: Path) -> None:
    ds = _load(tmp_path, [{"prompt": "Copy: 1 2", "response": "12"}])
    item = ds[0]
    # ChatML: the prompt is everything up to the generation prompt; the answer is "12" then <|im_end|>; the newline
    # the template writes after <|im_end|> is in the response (attended) but not trained.
    assert TOK.decode(item["prompt_ids"]) == "<|im_start|>user\nCopy: 1 2<|im_end|>\n<|im_start|>assistant\n"
    assert item["response_ids"] == [ord("1"), ord("2"), EOS, ord("\n")]
    assert item["loss_mask"] == [1, 1, 1, 0]
    assert ds.marked_text(0).endswith("<|im_start|>assistant\n[[12<|im_end|>]]\n")


def test_every_assistant_turn_of_a_conversation_trains(tmp_path: Path) -> None:
    rows = [{"messages": _chat("Copy: 1 2", "12", "Reverse: 3 4", "43", "Copy: 9", "9", system="Be brief.")}]
    ds = _load(tmp_path, rows)
    assert _trained(ds, 0) == ["12<|im_end|>", "43<|im_end|>", "9<|im_end|>"]
    text = ds.marked_text(0)
    assert "[[" not in text.split("<|im_start|>assistant")[0]  # system and first user turn: prompt, not trained
    assert "<|im_start|>user\nReverse: 3 4<|im_end|>\n" in text  # a later user turn: attended, not trained


def test_generation_marks_give_the_same_tokens_as_the_prefix_rendering(tmp_path: Path) -> None:
    """A template whose assistant output sits in {% generation %} is read through transformers' assistant mask;
    on ChatML it marks what rendering prefix by prefix finds."""
    marked = (
        "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
        "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    rows = [{"messages": _chat("Copy: 1 2", "12", "Reverse: 3 4", "43")}]
    by_prefix = _load(tmp_path, rows)
    by_marks = _load(tmp_path, rows, override_chat_template=marked)
    assert by_marks.chat.generation_marks and not by_prefix.chat.generation_marks
    assert by_marks[0] == by_prefix[0]


def test_template_flags_reach_the_template(tmp_path: Path) -> None:
    """`data.chat_template_kwargs` (Qwen3's enable_thinking) changes the rendering; the empty think block the flag
    adds to the generation prompt is the prompt's, not trained."""
    template = CHAT_TEMPLATE.replace(
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think></think>' -}}{%- endif -%}"
        "{%- endif -%}",
    ).replace(
        "{%- if message['content'] is string -%}{{- message['content'] -}}",
        "{%- if message['content'] is string -%}"
        "{%- if message['role'] == 'assistant' and enable_thinking is defined and enable_thinking is false -%}"
        "{{- '<think></think>' -}}{%- endif -%}{{- message['content'] -}}",
    )
    rows = [{"prompt": "Copy: 7", "response": "7"}]
    plain = _load(tmp_path, rows, override_chat_template=template)
    quiet = _load(tmp_path, rows, override_chat_template=template, chat_template_kwargs={"enable_thinking": False})
    assert "<think>" not in plain.marked_text(0)
    assert quiet.marked_text(0).endswith("<|im_start|>assistant\n<think></think>[[7<|im_end|>]]\n")


def test_tools_reach_the_template_as_a_list_or_json_text(tmp_path: Path) -> None:
    template = "{%- if tools -%}{{- 'TOOLS:' + (tools | map(attribute='name') | join(',')) + '\\n' -}}{%- endif -%}"
    tools = [{"name": "add", "parameters": {}}, {"name": "mul", "parameters": {}}]
    rows = [
        {"messages": _chat("2+3?", "5"), "tools": tools},
        {"messages": _chat("2*3?", "6"), "tools": json.dumps(tools)},
        {"messages": _chat("hi", "hello")},
    ]
    ds = _load(tmp_path, rows, override_chat_template=template + CHAT_TEMPLATE)
    assert ds.marked_text(0).startswith("TOOLS:add,mul\n") and ds.marked_text(1).startswith("TOOLS:add,mul\n")
    assert not ds.marked_text(2).startswith("TOOLS")
    assert _trained(ds, 0) == ["5<|im_end|>"]


def test_arrow_struct_fields_left_unset_do_not_reach_the_template(tmp_path: Path) -> None:
    """Parquet gives every message every field of the column's struct; a template testing `'tool_calls' in message`
    must not see the unset ones (None)."""
    template = CHAT_TEMPLATE.replace(
        "{{- message['content'] -}}", "{%- if 'tool_calls' in message -%}CALL{%- endif -%}{{- message['content'] -}}"
    )
    msgs = [
        {"role": "user", "content": "hi", "tool_calls": None},
        {"role": "assistant", "content": "yo", "tool_calls": None},
    ]
    ds = _load(tmp_path, [{"messages": msgs}], override_chat_template=template)
    assert "CALL" not in ds.marked_text(0) and _trained(ds, 0) == ["yo<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_stops_naming_the_row_and_the_fix(tmp_path: Path) -> None:
    """Like Qwen3's dropping of earlier reasoning: here only the last assistant turn shows its content. Refused even
    with on_bad_row=drop: it is the template's doing, and every multi-turn row would be trained wrong."""
    template = CHAT_TEMPLATE.replace(
        "{%- if message['content'] is string -%}{{- message['content'] -}}",
        "{%- if message['content'] is string -%}"
        "{%- if message['role'] != 'assistant' or loop.last -%}{{- message['content'] -}}{%- endif -%}",
    )
    rows = [{"messages": _chat("a", "1")}, {"messages": _chat("a", "1", "b", "2")}]
    with pytest.raises(DataError) as err:
        _load(tmp_path, rows, override_chat_template=template, on_bad_row="drop")
    message = str(err.value)
    assert "rows.jsonl, row 1" in message and "message 1" in message
    assert "{% generation %}" in message and "data.override_chat_template" in message and "\n" not in message


def test_a_template_that_renders_no_assistant_tokens_is_refused(tmp_path: Path) -> None:
    template = "{%- for m in messages if m['role'] != 'assistant' -%}{{- m['content'] -}}{%- endfor -%}"
    with pytest.raises(DataError, match=r"row 0: .*renders no tokens for message 1"):
        _load(tmp_path, [{"messages": _chat("a", "1")}], override_chat_template=template)


def test_bad_rows_are_counted_or_stop_naming_file_row_and_key(tmp_path: Path) -> None:
    rows = [
        {"messages": _chat("a", "1")},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"question": "x"},
        {"messages": "not a list"},
        {"prompt": "p", "response": ""},
    ]
    ds = _load(tmp_path, rows)
    assert len(ds) == 1
    assert ds.drop_counts == {"missing_messages": 1, "bad_messages": 1, "no_assistant_turn": 2}
    with pytest.raises(DataError) as err:
        _load(tmp_path, rows, on_bad_row="error")
    assert str(err.value).startswith(
        f"{tmp_path / 'rows.jsonl'}, row 1: no_assistant_turn: 'messages' has no assistant"
    )
    with pytest.raises(DataError, match=r"row 0: missing_messages: no .messages. column, nor both .prompt. and"):
        _load(tmp_path, [rows[2]], on_bad_row="error")


def test_overlong_conversations_are_dropped_or_stop(tmp_path: Path) -> None:
    rows = [{"prompt": "Copy: 1", "response": "1"}, {"prompt": "Copy: " + "1 " * 40, "response": "1" * 40}]
    ds = _load(tmp_path, rows, max_length=48)
    assert len(ds) == 1 and ds.drop_counts == {"overlong": 1}
    with pytest.raises(DataError, match=r"row 1: overlong: the conversation has \d+ tokens > sft.max_length=48"):
        _load(tmp_path, rows, max_length=48, overlong="error")


def test_collate_lays_conversations_out_as_the_rl_batch() -> None:
    items = [
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "loss_mask": [1, 0]},
        {"prompt_ids": [6], "response_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
    ]
    b = collate_sft(items, pad_token_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 6, 7, 8, 9]]  # prompts left-, responses right-padded
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b["responses"].tolist() == [[4, 5, 0], [7, 8, 9]]
    assert b["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b["loss_mask"].tolist() == [[1, 0, 0], [0, 1, 1]]
    assert all(t.dtype == torch.long for t in b.values())


def test_a_row_with_audio_is_refused_naming_the_row(tmp_path: Path) -> None:
    """SFT renders text only: a row's audio clip would be dropped without a word, so the row stops loading."""
    rows = [{"messages": _chat("a", "1")}, {"messages": _chat("what is said?", "hi"), "audios": ["clip.wav"]}]
    with pytest.raises(DataError) as err:
        _load(tmp_path, rows)
    assert "rows.jsonl, row 1: 'audios' has audio, which SFT does not take yet" in str(err.value)


def test_a_ten_megabyte_message_is_dropped_without_being_tokenized(tmp_path: Path) -> None:
    """As RL prompts are: the rendered conversation is proven longer than sft.max_length from its bytes alone (the
    old code tokenized it in full: 3.6 GB for a 10 MB message)."""
    from tests.data.test_length_bound import Recording

    tok = Recording(make_tokenizer())
    rows = [{"messages": _chat("a", "1")}, {"messages": _chat("x" * (10 * 2**20), "1")}, {"messages": _chat("b", "2")}]
    spec = _data(tmp_path, rows)
    ds = SFTDataset(spec, DataConfig(), SFTConfig(max_length=64), tok)
    assert len(ds) == 2 and ds.drop_counts == {"overlong": 1}
    assert tok.seen and max(tok.seen) < 1000, "the 10 MB message reached the tokenizer"
    with pytest.raises(DataError, match=r"row 1: overlong: the conversation has at least \d+ tokens .*not tokenized"):
        SFTDataset(spec, DataConfig(), SFTConfig(max_length=64, overlong="error"), tok)
    assert max(tok.seen) < 1000


ANSWER = {"role": "assistant", "content": "a cat"}


def _parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"messages": [_parts({"type": "image", "image": "cat.png"}, {"type": "text", "text": "What?"}), ANSWER]},
            r"'messages' message 0 has a content part of type 'image', which SFT does not take yet",
        ),
        (
            {"messages": [_parts({"image_url": {"url": "x.png"}}), ANSWER]},
            r"'messages' message 0 has a content part of type 'image_url'",
        ),
        ({"messages": _chat("What is shown?", "a cat"), "images": ["cat.png"]}, r"'images' has media"),
        ({"messages": _chat("What happens?", "a cat runs"), "videos": ["cat.mp4"]}, r"'videos' has media"),
    ],
    ids=["image_part", "untyped_image_url", "images_column", "videos_column"],
)
def test_image_content_is_refused_rather_than_trained_as_text(tmp_path: Path, row: dict[str, Any], match: str) -> None:
    rows = [{"messages": _chat("a", "1")}, row]
    with pytest.raises(DataError, match=r"rows\.jsonl, row 1: " + match):
        _load(tmp_path, rows)
    text_parts = {"messages": [_parts({"type": "text", "text": "hi"}), ANSWER]}
    assert len(_load(tmp_path, [text_parts])) == 1  # text parts stay welcome
