"""Data rows and data paths are not taken as given (issue 36): media paths stay inside `data.image_dir` /
`data.video_dir`, and a FIFO named as a data file is reported as such instead of blocking or "no data files"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from easyrl.data.loading import DataError, load_rows
from easyrl.data.media import MediaError, resolve_images, resolve_videos


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """images/ holding ok.png, and secret.png beside it (outside): both real, decodable images."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    for path in (images / "sub" / "ok.png", tmp_path / "secret.png"):
        Image.new("RGB", (4, 4), "red").save(path)
    (tmp_path / "secret.mp4").write_bytes(b"\0" * 16)
    return images, tmp_path


def test_media_paths_are_confined_to_their_folder(folders: tuple[Path, Path]) -> None:
    images, outside = folders
    assert (
        resolve_images(["sub/ok.png", {"path": "sub/../sub/ok.png"}], str(images))
        == [str(images / "sub" / "ok.png")] * 2
    )
    for ref in ("../secret.png", str(outside / "secret.png"), {"path": "sub/../../secret.png"}):
        with pytest.raises(MediaError, match=r"image path .* lies outside data\.image_dir"):
            resolve_images([ref], str(images))
    with pytest.raises(MediaError, match=r"video path '\.\./secret\.mp4' lies outside data\.video_dir"):
        resolve_videos(["../secret.mp4"], str(images))
    # No folder configured: the row's path is used as given (a local dataset of absolute paths).
    assert resolve_images([str(outside / "secret.png")], None) == [str(outside / "secret.png")]


def test_a_fifo_is_named_as_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"train\.jsonl is not a regular file or folder \(a FIFO"):
        load_rows(str(fifo))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    os.mkfifo(folder / "b.jsonl")  # reading it would block forever
    with pytest.raises(DataError, match=r"b\.jsonl is not a regular file \(a FIFO.*remove it from"):
        load_rows(str(folder))
