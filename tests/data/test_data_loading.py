"""load_rows: every supported source form, and clear errors naming the path."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from easyrl.data import DataError, load_rows


ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _prompts(rows: list) -> list[str]:
    return [row["prompt"] for _, _, row in rows]


def test_each_file_type(tmp_path: Path) -> None:
    jsonl = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS), encoding="utf-8")
    pd.DataFrame(ROWS).to_parquet(tmp_path / "c.parquet")
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.csv", index=False)
    for name in ("a.jsonl", "b.json", "c.parquet", "d.csv"):
        rows = load_rows(str(tmp_path / name))
        assert _prompts(rows) == ["q0", "q1", "q2"], name
        assert [(src, idx) for src, idx, _ in rows] == [(str(tmp_path / name), i) for i in range(3)]
    # CSV cells stay strings exactly as written.
    assert load_rows(str(tmp_path / "d.csv"))[2][2]["answer"] == "2"
    rows = load_rows(str(jsonl))
    assert rows[0][2] == ROWS[0]


def test_json_lines_in_json_and_wrapped_list(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "lines.json", ROWS)
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": ROWS}), encoding="utf-8")
    assert _prompts(load_rows(str(tmp_path / "lines.json"))) == ["q0", "q1", "q2"]
    assert _prompts(load_rows(str(tmp_path / "wrapped.json"))) == ["q0", "q1", "q2"]


def test_folder_comma_list_and_split_files(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", ROWS[:2])
    pd.DataFrame(ROWS[2:]).to_parquet(folder / "train-00001-of-00002.parquet")
    _write_jsonl(folder / "test.jsonl", [{"prompt": "t", "answer": "0"}])
    (folder / ".hidden.jsonl").write_text("not json\n", encoding="utf-8")
    assert len(load_rows(str(folder))) == 4
    # Files are read in sorted name order.
    assert _prompts(load_rows(f"{folder}@train")) == ["q2", "q0", "q1"]
    assert _prompts(load_rows(f"{folder}@test")) == ["t"]
    both = load_rows(f"{folder / 'test.jsonl'}, {folder / 'train.jsonl'}")
    assert _prompts(both) == ["t", "q0", "q1"]
    sub = tmp_path / "nested"
    (sub / "validation").mkdir(parents=True)
    _write_jsonl(sub / "validation" / "part.jsonl", ROWS[:1])
    assert _prompts(load_rows(f"{sub}@validation")) == ["q0"]


def test_save_to_disk_dataset_and_dict(tmp_path: Path) -> None:
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert _prompts(load_rows(str(single))) == ["q0", "q1", "q2"]
    multi = tmp_path / "multi"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(multi))
    rows = load_rows(f"{multi}@test")
    assert _prompts(rows) == ["q0"]
    assert rows[0][0] == f"{multi}@test"
    with pytest.raises(DataError, match="choose one"):
        load_rows(str(multi))
    with pytest.raises(DataError, match="no split 'dev'"):
        load_rows(f"{multi}@dev")


def test_save_to_disk_images_stay_encoded(tmp_path: Path) -> None:
    """Image features come back as their stored {bytes, path} struct, not decoded PIL images."""
    from PIL import Image

    image_path = tmp_path / "red.png"
    Image.new("RGB", (4, 4), "red").save(image_path)
    ds = datasets.Dataset.from_dict({"prompt": ["<image>what?"], "answer": ["red"], "images": [[str(image_path)]]})
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    ds.save_to_disk(str(tmp_path / "vl"))
    row = load_rows(str(tmp_path / "vl"))[0][2]
    assert isinstance(row["images"][0], dict)
    assert row["images"][0]["bytes"] is not None or row["images"][0]["path"]


def test_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=str(missing)):
        load_rows(str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{oops\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2"):
        load_rows(str(bad))
    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match=r"x\.txt: unsupported file type"):
        load_rows(str(tmp_path / "x.txt"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read"):
        load_rows(str(tmp_path / "broken.parquet"))
    (tmp_path / "scalar.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(DataError, match=r"scalar\.json, row 0"):
        load_rows(str(tmp_path / "scalar.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no data files"):
        load_rows(str(empty))
    with pytest.raises(DataError, match="no files for split 'train'"):
        load_rows(f"{empty}@train")
    with pytest.raises(DataError, match="empty"):
        load_rows(" , ")
    # DataError is a ValueError, so generic config-error handling catches it.
    assert issubclass(DataError, ValueError)
