"""Validation of a row's image and video references at load time (pixels are not kept).

A row may name images as paths (relative to ``data.image_dir``, and confined to it when it is set), raw bytes, ``{"bytes", "path"}`` structs (the
form `datasets` and HF parquet files store images in), or a list of these. Each is resolved to a path or bytes and
checked to be decodable by Pillow, so that an unreadable image is found before training starts rather than when
its batch comes up hours later.
"""

from __future__ import annotations

import io
import os
from typing import Any


__all__ = ["MediaError", "resolve_audios", "resolve_images", "resolve_videos"]

MediaRef = str | bytes
"""A resolved media reference: an absolute (or as-given) file path, or the encoded file's bytes."""


class MediaError(ValueError):
    """A media reference is missing, has an unsupported form or cannot be decoded."""


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _resolve_one(item: Any, base_dir: str | None, what: str) -> MediaRef | None:
    """One reference as a path or bytes; ``None`` for an empty slot (e.g. a null image struct)."""
    if isinstance(item, dict):
        data = item.get("bytes")
        if data:
            return bytes(data)
        item = item.get("path")
        if not item:
            return None
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str):
        if not item:
            return None
        return _confined(item, base_dir, what)
    raise MediaError(f"unsupported media reference of type {type(item).__name__}")


def _confined(item: str, base_dir: str | None, what: str) -> str:
    """`item` joined onto `base_dir`; it must stay inside: rows (a hub dataset's included) are data, and a row
    naming `../../home/me/.ssh/id_rsa` or `/etc/shadow` must not make the run open it. The check is lexical
    (normpath), so a symlink the folder's owner placed inside it is still followed. No `base_dir`: as given."""
    if base_dir is None:
        return item
    base = os.path.normpath(os.path.abspath(base_dir))
    path = os.path.normpath(os.path.join(base, item))  # an absolute `item` replaces `base` here, and is caught
    if os.path.commonpath([base, path]) != base:
        raise MediaError(
            f"{what} path {item!r} lies outside data.{what}_dir ({base}); rows may only name files inside it "
            "(relative paths without '..')"
        )
    return path


def _check_image(ref: MediaRef, cache: dict[str, str | None]) -> None:
    """Raise :class:`MediaError` unless Pillow can identify and verify the image."""
    from PIL import Image

    key = ref if isinstance(ref, str) else None
    if key is not None and key in cache:
        if cache[key] is not None:
            raise MediaError(cache[key])
        return
    error: str | None = None
    if isinstance(ref, str) and not os.path.isfile(ref):
        error = f"image file not found: {ref}"
    else:
        try:
            source: Any = ref if isinstance(ref, str) else io.BytesIO(ref)
            with Image.open(source) as image:
                # verify() checks the file's structure without decoding the pixels; cheap enough for every row.
                image.verify()
        except Exception as exc:
            where = ref if isinstance(ref, str) else f"<{len(ref)} bytes>"
            error = f"image not decodable ({where}): {type(exc).__name__}: {exc}"
    if key is not None:
        # Many rows share an image; check each path once.
        cache[key] = error
    if error is not None:
        raise MediaError(error)


def resolve_images(value: Any, image_dir: str | None, cache: dict[str, str | None] | None = None) -> list[MediaRef]:
    """Resolve and validate a row's image column.

    Args:
        value: the column's value (a reference or a list of them; ``None`` means no image).
        image_dir: folder that relative paths are resolved against.
        cache: per-path results shared across rows (pass the same dict for a whole dataset).

    Returns:
        The images as paths or bytes, in order.

    Raises:
        MediaError: the first missing, malformed or undecodable image.
    """
    cache = {} if cache is None else cache
    refs: list[MediaRef] = []
    for item in _as_list(value):
        ref = _resolve_one(item, image_dir, "image")
        if ref is None:
            continue
        _check_image(ref, cache)
        refs.append(ref)
    return refs


def resolve_videos(value: Any, video_dir: str | None) -> list[MediaRef]:
    """Resolve a row's video column; paths must exist (frames are decoded later, by the media pipeline)."""
    return _resolve_files(value, video_dir, "video")


def resolve_audios(value: Any, audio_dir: str | None) -> list[MediaRef]:
    """Resolve a row's audio column; paths must exist (clips are decoded later, by `easyrl.data.audio`)."""
    return _resolve_files(value, audio_dir, "audio")


def _resolve_files(value: Any, folder: str | None, kind: str) -> list[MediaRef]:
    """A column of `kind` items read later from files (or given as bytes): each resolved, each path checked."""
    refs: list[MediaRef] = []
    for item in _as_list(value):
        ref = _resolve_one(item, folder, kind)
        if ref is None:
            continue
        if isinstance(ref, str) and not os.path.isfile(ref):
            raise MediaError(f"{kind} file not found: {ref}")
        refs.append(ref)
    return refs
