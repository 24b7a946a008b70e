"""Reading raw rows from local data files: jsonl, json, parquet, csv, folders of them and `save_to_disk` folders.

Every row comes back with the file it came from and its index in that file, so that a bad row can be reported
precisely ("data/train.jsonl, row 17: missing_prompt") instead of as an anonymous position in a merged list.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


__all__ = ["SUPPORTED_EXTENSIONS", "DataError", "Row", "load_rows"]

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")
"""File types read by :func:`load_rows` (matched case-insensitively)."""

Row = tuple[str, int, dict[str, Any]]
"""``(source_file, row_index, row)``: where a row came from and its columns."""


class DataError(ValueError):
    """A data file or row cannot be used; the message names the path (and the row where there is one)."""


def load_rows(spec: str) -> list[Row]:
    """Read every row named by ``spec``.

    ``spec`` is a comma-separated list of entries; each entry is one of:

    * a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file;
    * a folder: a ``datasets`` folder saved with ``save_to_disk`` is read as a dataset, any other folder
      contributes all supported files below it (sorted, hidden files skipped);
    * ``path@split``: the ``split`` of a ``save_to_disk`` ``DatasetDict`` folder, or the files of a folder
      named after the split (``train.jsonl``, ``train-00000-of-00002.parquet``, ``train/``...).

    Returns:
        ``(source_file, row_index, row)`` tuples in file order; ``row_index`` counts rows within its source.

    Raises:
        DataError: naming the path, when an entry does not exist, has an unsupported type or cannot be parsed.
    """
    entries = [part.strip() for part in spec.split(",") if part.strip()]
    if not entries:
        raise DataError(f"no data files given (spec {spec!r} is empty)")
    rows: list[Row] = []
    for entry in entries:
        path, split = _split_entry(entry)
        rows.extend(_load_entry(path, split))
    return rows


def _split_entry(entry: str) -> tuple[str, str | None]:
    """Separate ``path@split``; an existing path containing ``@`` is taken literally."""
    if "@" in entry and not os.path.exists(entry):
        path, split = entry.rsplit("@", 1)
        if split and "/" not in split and os.sep not in split:
            return path, split
    return entry, None


def _load_entry(path: str, split: str | None) -> list[Row]:
    if not os.path.exists(path):
        raise DataError(f"data path not found: {path}")
    if os.path.isfile(path):
        if split is not None:
            raise DataError(f"{path}@{split}: a split can only be selected from a folder, not from a file")
        return list(_read_file(path))
    if not os.path.isdir(path):  # a FIFO would block the first read forever; a device or socket is no data either
        raise DataError(f"{path} is not a regular file or folder (a FIFO, socket or device); give a data file")
    if _is_saved_dataset(path):
        return _read_saved_dataset(path, split)
    files = _split_files(path, split) if split is not None else _folder_files(path)
    if not files:
        what = f"files for split {split!r}" if split is not None else "data files"
        raise DataError(f"{path}: no {what} found (looked for {', '.join(SUPPORTED_EXTENSIONS)})")
    rows: list[Row] = []
    for file in files:
        rows.extend(_read_file(file))
    return rows


def _is_saved_dataset(path: str) -> bool:
    """A ``save_to_disk`` folder: a DatasetDict has ``dataset_dict.json``, a Dataset ``state.json``."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json"))


def _is_supported(name: str) -> bool:
    return name.lower().endswith(SUPPORTED_EXTENSIONS) and not name.startswith(".")


def _folder_files(folder: str) -> list[str]:
    found: list[str] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            file = os.path.join(root, name)
            if _is_supported(name) and not os.path.isfile(file):
                raise DataError(f"{file} is not a regular file (a FIFO, socket or device); remove it from {folder}")
            if _is_supported(name):
                found.append(file)
    return found


def _split_files(folder: str, split: str) -> list[str]:
    """Files of ``split`` in ``folder``: ``<split>.<ext>``, sharded ``<split>-*.<ext>`` or a ``<split>/`` folder."""
    sub = os.path.join(folder, split)
    if os.path.isdir(sub):
        return _folder_files(sub)
    found = []
    for file in _folder_files(folder):
        stem = Path(file).name.split(".", 1)[0]
        if stem == split or stem.startswith(f"{split}-") or stem.startswith(f"{split}_"):
            found.append(file)
    return found


def _read_file(path: str) -> Iterator[Row]:
    lower = path.lower()
    try:
        if lower.endswith(".jsonl"):
            records = _read_jsonl(path)
        elif lower.endswith(".json"):
            records = _read_json(path)
        elif lower.endswith(".parquet"):
            records = _read_parquet(path)
        elif lower.endswith(".csv"):
            records = _read_csv(path)
        else:
            raise DataError(f"{path}: unsupported file type (supported: {', '.join(SUPPORTED_EXTENSIONS)})")
    except DataError:
        raise
    except Exception as exc:  # any parser failure becomes one clear message naming the file
        raise DataError(f"{path}: cannot be read: {type(exc).__name__}: {exc}") from exc
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}, row {index}: expected an object of columns, got {type(record).__name__}")
        yield path, index, record


def _read_jsonl(path: str) -> list[Any]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, line {line_no}: invalid JSON: {exc}") from exc
    return records


def _read_json(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # JSON-lines content under a .json name is common enough to accept.
        return _read_jsonl(path)
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        # A single top-level list (e.g. {"data": [...]}) is the table; anything else is ambiguous.
        lists = [value for value in data.values() if isinstance(value, list)]
        if len(data) == 1 and len(lists) == 1:
            return lists[0]
    raise DataError(f"{path}: expected a JSON list of objects (or JSON lines)")


def _read_parquet(path: str) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_csv(path: str) -> list[Any]:
    # The csv module keeps every cell a string: answers such as "007" or "1e3" stay exactly as written.
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def _read_saved_dataset(path: str, split: str | None) -> list[Row]:
    try:
        import datasets

        loaded = datasets.load_from_disk(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot load the saved dataset: {type(exc).__name__}: {exc}") from exc
    source = path
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded.keys())
        if split is None:
            if len(splits) != 1:
                raise DataError(f"{path}: holds splits {splits}; choose one with {path}@<split>")
            split = splits[0]
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r} (available: {splits})")
        dataset = loaded[split]
        source = f"{path}@{split}"
    else:
        if split is not None:
            raise DataError(f"{path}@{split}: the folder holds a single Dataset without splits")
        dataset = loaded
    # The arrow view keeps media columns as their stored {bytes, path} structs instead of decoding every image.
    table = dataset.with_format("arrow")[:]
    return [(source, index, record) for index, record in enumerate(table.to_pylist())]
