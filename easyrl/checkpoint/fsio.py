"""Durable file-system primitives for checkpoints, and the only readers the package uses.

Every mutating step of a save goes through a function of this module (write, fsync, rename, replace, remove),
so a crash can only happen between two of them, and tests can inject a failure at each boundary by
monkeypatching these functions. Reading is restricted to JSON and safetensors: nothing here (or anywhere in the
package) unpickles, so a planted pickle payload is refused as malformed and never runs.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from easyrl.checkpoint.errors import CheckpointError


logger = logging.getLogger(__name__)


def fsync_file(path: str) -> None:
    """Flush a file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (new, renamed or removed names) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not support fsync on directories
        logger.debug("fsync of directory %s not supported", path, exc_info=True)
    finally:
        os.close(fd)


def makedirs(path: str) -> None:
    """Create `path` (and parents) if missing."""
    os.makedirs(path, exist_ok=True)


def rename(src: str, dst: str) -> None:
    """Atomically rename `src` to `dst` (same file system); `dst` must not be a non-empty directory."""
    os.rename(src, dst)


def replace(src: str, dst: str) -> None:
    """Atomically replace the file `dst` by `src`."""
    os.replace(src, dst)


def rmtree(path: str) -> None:
    """Remove a folder tree, ignoring a folder that is already gone."""
    if os.path.isdir(path):
        shutil.rmtree(path)


@contextmanager
def folder_replaced_atomically(out: str) -> Iterator[str]:
    """A temporary sibling of `out` to fill; when the block ends normally it is flushed and renamed over `out` (an
    older `out` removed first), when it raises it is removed and `out` stays as it was."""
    tmp = f"{out}.tmp_{secrets.token_hex(4)}"
    makedirs(tmp)
    try:
        yield tmp
        fsync_dir(tmp)
        if os.path.exists(out):
            rmtree(out)
        rename(tmp, out)
        fsync_dir(os.path.dirname(out))
    except BaseException:
        rmtree(tmp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` and fsync it (not atomic: use inside a folder not yet committed)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as JSON and fsync it. Raises CheckpointError if `obj` is not JSON-serializable."""
    try:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot write {path}: the state is not JSON-serializable ({exc})") from exc
    write_bytes(path, text.encode("utf-8"))


def write_json_atomic(path: str, obj: Any) -> None:
    """Replace `path` by `obj` as JSON atomically: write a temp file, fsync, os.replace, fsync the folder."""
    tmp = f"{path}.tmp.{os.getpid()}"
    write_json(tmp, obj)
    replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def copy_file(src: str, dst: str) -> None:
    """Copy a file's bytes and fsync the copy."""
    shutil.copyfile(src, dst)
    fsync_file(dst)


def save_tensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (moved to CPU, made contiguous) as safetensors and fsync the file."""
    from safetensors.torch import save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    try:
        save_file(cpu, path, metadata=dict(metadata) if metadata else None)
    except Exception as exc:
        # safetensors reports a failed write (full disk, quota) as its own error type: make it the OSError it is,
        # so callers that answer a full disk with one line see it as one.
        if "I/O error" in str(exc):
            raise OSError(f"cannot write {path}: {exc}") from exc
        raise
    # safetensors creates its file owner-only (0600), unlike every other file here (0666 less the umask): a merged
    # model copied for serving was half unreadable. One mode for every file, the one the user's umask asks for.
    os.chmod(path, 0o666 & ~current_umask())
    fsync_file(path)


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (another thread may be creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable read is to set it and put it back
    os.umask(mask)
    return mask


METADATA_CAP_BYTES = 256 << 20
"""The largest JSON metadata file read (manifest, run config, scores, optimizer layout): far above what a save
writes, far below what would take the driver's memory."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def _not_regular(path: str, mode: int) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} is {_kind(mode)}, not a regular file: refusing to read it (replace it with the "
        "file the save wrote, or move the checkpoint away)"
    )


def require_regular(path: str) -> None:
    """Raise CheckpointError unless `path` (symlinks followed) is a regular file: a FIFO, `/dev/zero` or a socket
    planted in a checkpoint would block or never end a read (safetensors and the hashing open files themselves)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def read_regular(path: str, cap: int = METADATA_CAP_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `cap` of them; CheckpointError naming the file otherwise.

    Opened with O_NONBLOCK: opening a FIFO for reading blocks until a writer comes, so the type is checked on the
    open descriptor (no window between a check and the open), never by a read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, info.st_mode)
        if info.st_size > cap:
            raise CheckpointError(
                f"checkpoint file {path} is {info.st_size} bytes, more than the {cap} a metadata file of easyrl can "
                "be: refusing to read it (replace it with the file the save wrote, or move the checkpoint away)"
            )
        data = handle.read(cap + 1)  # a file growing while read is still capped
    if len(data) > cap:
        raise CheckpointError(f"checkpoint file {path} grew past {cap} bytes while read: refusing it")
    return data


def read_json(path: str, cap: int = METADATA_CAP_BYTES) -> Any:
    """Parse a JSON file of at most `cap` bytes; anything else (a pickle, binary junk, a missing file, a FIFO or
    device, a huge file) raises CheckpointError naming the file."""
    try:
        return json.loads(read_regular(path, cap).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: 100k-deep nesting
        raise CheckpointError(f"checkpoint file {path} is not valid JSON; refusing to load it ({exc})") from exc


def read_tensor_metadata(path: str) -> dict[str, str]:
    """The `__metadata__` of a safetensors header, validating the file (CheckpointError if it is not safetensors)."""
    from safetensors import safe_open

    require_regular(path)
    try:
        with safe_open(path, framework="pt") as handle:
            return dict(handle.metadata() or {})
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except Exception as exc:  # SafetensorError and friends: malformed header, truncated file, ...
        raise CheckpointError(
            f"checkpoint file {path} is not a valid safetensors file; refusing to load it ({exc})"
        ) from exc


def read_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the header metadata of a safetensors file (CheckpointError if it is not safetensors)."""
    from safetensors import safe_open

    require_regular(path)
    try:
        with safe_open(path, framework="pt") as handle:
            meta = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} is not a valid safetensors file; refusing to load it ({exc})"
        ) from exc
    return tensors, meta


def json_metadata(meta: Mapping[str, str], key: str, path: str) -> Any:
    """Decode the JSON stored under `key` in a safetensors header."""
    if key not in meta:
        raise CheckpointError(f"checkpoint file {path} has no {key!r} entry in its header (not written by easyrl?)")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint file {path} has a malformed {key!r} header entry ({exc})") from exc
