"""The driver side: atomic checkpoint folders, the `latest` tracker, pruning, and the trainer's own state.

A save goes::

    tmp = manager.begin(step)                    # <root>/.tmp_global_step_<N>_<random>
    actor.save_checkpoint(f"{tmp}/actor", ...)   # the workers write their shards
    write_trainer_state(tmp, state)              # trainer_state.json + trainer_rng.safetensors
    manager.commit(tmp, step, val_score)         # manifest, rename, tracker, prune

`commit` writes the `COMPLETE` manifest last (file names, sizes and SHA-256 digests), fsyncs, renames the folder to
`<root>/global_step_<N>`, fsyncs the root, atomically replaces `latest_checkpointed_iteration.txt`, and only
then prunes old checkpoints. A crash at any point leaves every previously committed checkpoint intact; the
next `CheckpointManager` on the same root removes the leftovers.

Before a resume (and before `easyrl merge`) :func:`verify_checkpoint` re-hashes every file against the manifest
and checks the step recorded in the manifest and in `trainer_state.json` against the folder name, so a shard
overwritten in place (same size) or an edited trainer state is refused by name instead of loading silently.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError
from easyrl.checkpoint.rng import RngState


logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_global_step_"
OLD_PREFIX = ".old_global_step_"
TRASH_PREFIX = ".trash_global_step_"
MANIFEST = "COMPLETE"
TRACKER = "latest_checkpointed_iteration.txt"
SCORES = "checkpoint_scores.json"
TRAINER_STATE = "trainer_state.json"
TRAINER_RNG = "trainer_rng.safetensors"
RUN_CONFIG = "experiment_config.json"  # the masked config the checkpoint was saved under (compared on resume)
TRAINER_STATE_CAP_BYTES = 4 << 30
"""The largest `trainer_state.json` read: it carries the tokens of the groups in flight under carry-over (up to a
few GB at the largest `active_groups` x n x response lengths a config allows), so its cap is above the other
metadata files'."""
MANIFEST_FORMAT = "easyrl-checkpoint-v1"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_HIDDEN_RE = re.compile(r"^\.(?:tmp|old|trash)_global_step_(\d+)_[0-9a-f]+$")


def file_sha256(path: str) -> str:
    """SHA-256 of a file, read in 4 MiB blocks (hashlib releases the GIL, so threads hash files in parallel)."""
    digest = hashlib.sha256()
    fsio.require_regular(path)  # a FIFO or /dev/zero listed in a manifest would never end the loop below
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_files(paths: list[str]) -> list[str]:
    """SHA-256 of each path, several files at a time (a checkpoint is a few large shards)."""
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="easyrl-ckpt-hash") as pool:
        return list(pool.map(file_sha256, paths))


def _list_files(folder: str) -> list[str]:
    """Relative paths of every file under `folder` (the manifest excluded), sorted."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The `COMPLETE` manifest of a checkpoint folder, or None when it is missing or malformed."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        manifest = fsio.read_json(path)
    except CheckpointError:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def is_complete(folder: str, verify_checksums: bool = False) -> bool:
    """Whether `folder` holds a manifest and every file it lists, each with the listed size (and hash)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    root = os.path.abspath(folder)
    for rel, entry in manifest["files"].items():
        path = os.path.abspath(os.path.join(folder, rel))
        # A manifest entry must name a file inside the folder: `../x` or an absolute path is refused.
        if not path.startswith(root + os.sep) or not isinstance(entry, dict):
            return False
        try:
            fsio.require_regular(path)
            if os.path.getsize(path) != entry.get("size"):
                return False
        except (OSError, CheckpointError):
            return False
        if verify_checksums and "sha256" in entry and file_sha256(path) != entry["sha256"]:
            return False
    return True


def is_resumable(folder: str) -> bool:
    """Whether a complete checkpoint carries the trainer state needed to resume (not saved model-only)."""
    manifest = read_manifest(folder)
    return bool(manifest and manifest.get("resumable")) and is_complete(folder)


def newest_resumable(root: str) -> str | None:
    """The newest resumable `global_step_<N>` folder under `root`, or None; reads only (unlike `CheckpointManager`,
    which clears the leftovers of interrupted saves when it starts)."""
    try:
        steps = sorted((int(m.group(1)) for e in os.listdir(root) if (m := _STEP_RE.match(e))), reverse=True)
    except OSError:
        return None
    return next((f for f in (os.path.join(root, f"{STEP_PREFIX}{s}") for s in steps) if is_resumable(f)), None)


def folder_step(folder: str) -> int | None:
    """N of a `global_step_<N>` folder name, else None."""
    match = _STEP_RE.match(os.path.basename(os.path.abspath(folder)))
    return int(match.group(1)) if match else None


def _check_steps(folder: str, manifest: dict[str, Any]) -> None:
    """The step in the manifest and in `trainer_state.json` must be the folder's (an edited state would resume
    at the wrong step and train nothing)."""
    saved = manifest.get("step")
    named = folder_step(folder)
    if named is not None and saved != named:
        raise CheckpointError(
            f"{os.path.join(folder, MANIFEST)} records step {saved}, but the folder is global_step_{named}"
        )
    state_path = os.path.join(folder, TRAINER_STATE)
    if not os.path.lexists(state_path):
        return
    doc = fsio.read_json(state_path, TRAINER_STATE_CAP_BYTES)
    state = doc.get("state") if isinstance(doc, dict) else None
    step = state.get("global_step") if isinstance(state, dict) else None
    if step != saved:
        raise CheckpointError(
            f"{state_path} has global_step {step}, but the checkpoint is step {saved} "
            f"({os.path.basename(os.path.abspath(folder))}): the file was edited or comes from another checkpoint"
        )


def verify_checkpoint(folder: str, checksums: bool = True) -> None:
    """Raise CheckpointError naming the first file of `folder` that is missing, has another size, or (with
    `checksums`) another SHA-256 than its manifest records, or a step that does not match the folder name.

    `checksums=False` checks sizes and steps only (reads no data: for very large checkpoints).
    """
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = read_manifest(folder)
    if manifest is None:
        if not os.path.exists(manifest_path):
            raise CheckpointError(
                f"{folder} has no {MANIFEST} manifest, so it is not a checkpoint written by easyrl train (or its "
                "save was interrupted before the end); pass a global_step_<N> folder of a run"
            )
        raise CheckpointError(f"{manifest_path} is not a valid manifest: {folder} is not a complete easyrl checkpoint")
    _check_steps(folder, manifest)
    root = os.path.abspath(folder)
    to_hash: list[tuple[str, str]] = []
    unhashed = 0
    for rel, entry in sorted(manifest["files"].items()):
        path = os.path.abspath(os.path.join(folder, rel))
        if not path.startswith(root + os.sep) or not isinstance(entry, dict):
            raise CheckpointError(f"{manifest_path} lists {rel!r}, which is not a file of the checkpoint")
        if not os.path.lexists(path):
            raise CheckpointError(f"checkpoint file {path} is missing (listed in {manifest_path})")
        fsio.require_regular(path)  # a FIFO or device is named as such, never read
        size = os.path.getsize(path)
        if size != entry.get("size"):
            raise CheckpointError(
                f"checkpoint file {path} is {size} bytes, the manifest records {entry.get('size')}: "
                "it is truncated or was changed after the save"
            )
        if checksums and isinstance(entry.get("sha256"), str):
            to_hash.append((path, entry["sha256"]))
        elif checksums:
            unhashed += 1
    for (path, expected), actual in zip(to_hash, _hash_files([p for p, _ in to_hash])):
        if actual != expected:
            raise CheckpointError(
                f"checkpoint file {path} does not match the SHA-256 recorded in {manifest_path}: "
                "it was corrupted or changed after the save"
            )
    if unhashed:
        logger.warning(
            "%s: %d files have no checksum in the manifest (an older save); only sizes checked", folder, unhashed
        )


# --------------------------------------------------------------------------------------------- trainer state
def write_trainer_state(folder: str, state: dict[str, Any], rng: RngState | None = None) -> None:
    """Write the driver's state (`trainer_state.json`) and RNG (`trainer_rng.safetensors`) into `folder`.

    `state` must be JSON-serializable (step counters, sampler / controller `state_dict()`s...). `rng` defaults
    to the calling process's RNG state; its Python/NumPy part is stored inside `trainer_state.json`.
    """
    rng = rng or RngState.capture()
    fsio.save_tensors(os.path.join(folder, TRAINER_RNG), rng.tensors, {"format": "easyrl-rng-v1"})
    fsio.write_json(os.path.join(folder, TRAINER_STATE), {"format": MANIFEST_FORMAT, "state": state, "rng": rng.info})


def read_run_config(folder: str) -> dict[str, Any] | None:
    """The config saved with the checkpoint `folder` (JSON only), or None for a checkpoint saved before it was kept."""
    path = os.path.join(folder, RUN_CONFIG)
    if not os.path.lexists(path):
        return None
    doc = fsio.read_json(path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} is not a config written by easyrl")
    return doc


def read_trainer_state(folder: str) -> tuple[dict[str, Any], RngState]:
    """(state, RNG) written by :func:`write_trainer_state`; only JSON and safetensors are parsed."""
    path = os.path.join(folder, TRAINER_STATE)
    doc = fsio.read_json(path, TRAINER_STATE_CAP_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict) or not isinstance(doc.get("rng"), dict):
        raise CheckpointError(f"{path} is not a trainer state written by easyrl")
    tensors, _ = fsio.read_tensors(os.path.join(folder, TRAINER_RNG))
    if "torch_cpu" not in tensors:
        raise CheckpointError(f"{os.path.join(folder, TRAINER_RNG)} has no torch_cpu generator state")
    return doc["state"], RngState(tensors, doc["rng"])


# --------------------------------------------------------------------------------------------- the manager
class CheckpointManager:
    """Commits, finds and prunes the `global_step_<N>` checkpoints under `root`.

    Args:
        root: the checkpoint folder of the run (created if missing).
        save_limit: keep the newest `save_limit` complete checkpoints plus the best by validation score;
            -1 keeps all.
        higher_is_better: whether a higher validation score is better.
    """

    def __init__(self, root: str, save_limit: int = -1, higher_is_better: bool = True) -> None:
        if save_limit == 0 or save_limit < -1:
            raise ValueError(f"save_limit must be -1 (keep all) or a positive number, got {save_limit}")
        self.root = os.path.abspath(root)
        self.save_limit = save_limit
        self.higher_is_better = higher_is_better
        fsio.makedirs(self.root)
        self._recover()

    # ------------------------------------------------------------------ paths
    def step_folder(self, step: int) -> str:
        return os.path.join(self.root, f"{STEP_PREFIX}{step}")

    def complete_steps(self) -> list[int]:
        """Steps of the complete `global_step_*` folders, ascending."""
        steps = []
        for entry in os.listdir(self.root):
            match = _STEP_RE.match(entry)
            if match and is_complete(os.path.join(self.root, entry)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    # ------------------------------------------------------------------ startup
    def _recover(self) -> None:
        """Undo what a crash left: restore a checkpoint moved aside while being replaced, drop temp folders."""
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            match = _HIDDEN_RE.match(entry)
            # First restore: a replace that crashed between its two renames left the old checkpoint aside (.old_). The
            # pass below deletes every hidden folder, so it must come second.
            if match and entry.startswith(OLD_PREFIX):
                target = self.step_folder(int(match.group(1)))
                if not is_complete(target) and is_complete(path):  # the new one never arrived, or is partial
                    # A partial target goes to the trash (deleted below), freeing its name at once.
                    if os.path.exists(target):
                        fsio.rename(
                            target, os.path.join(self.root, f"{TRASH_PREFIX}{match.group(1)}_{secrets.token_hex(4)}")
                        )
                    fsio.rename(path, target)
                    fsio.fsync_dir(self.root)
                    logger.warning("restored %s, which a crash left aside while it was being replaced", target)
                    continue
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            if _HIDDEN_RE.match(entry) or (entry.startswith(f"{TRACKER}.tmp") or entry.startswith(f"{SCORES}.tmp")):
                logger.info("removing %s left by an interrupted save", path)
                if os.path.isdir(path):
                    fsio.rmtree(path)
                else:
                    os.remove(path)
        fsio.fsync_dir(self.root)

    # ------------------------------------------------------------------ saving
    def begin(self, step: int) -> str:
        """Create and return the temporary folder `<root>/.tmp_global_step_<step>_<random>` to write into."""
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{step}_{secrets.token_hex(4)}")
        fsio.makedirs(tmp)
        return tmp

    def abort(self, tmp: str) -> None:
        """Throw away a temporary folder whose save failed."""
        try:
            fsio.rmtree(tmp)
        except OSError:
            logger.warning("could not remove %s (it will be removed at the next start)", tmp, exc_info=True)

    def commit(self, tmp: str, step: int, val_score: float | None = None) -> str:
        """Seal `tmp` (manifest, fsync), publish it as `global_step_<step>`, update the tracker, then prune.

        Returns the final folder. If a `global_step_<step>` already exists it is replaced (moved aside first,
        restored by the next start if a crash interrupts the swap).
        """
        if os.path.dirname(os.path.abspath(tmp)) != self.root or not os.path.isdir(tmp):
            raise CheckpointError(f"{tmp} is not a temporary folder of {self.root} (use begin())")
        # Make every name in the folder durable (fsio fsynced each file as it wrote it), deepest folder first.
        for dirpath, _, _ in sorted(os.walk(tmp), key=lambda w: -w[0].count(os.sep)):
            fsio.fsync_dir(dirpath)
        rels = _list_files(tmp)
        digests = _hash_files([os.path.join(tmp, rel) for rel in rels])
        files = {
            rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "sha256": digest}
            for rel, digest in zip(rels, digests)
        }
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "files": files,
            "resumable": os.path.exists(os.path.join(tmp, TRAINER_STATE)),
            "val_score": val_score,
            "time": time.time(),
        }
        # The manifest goes last: its presence, with every listed size, is what makes a folder complete.
        fsio.write_json(os.path.join(tmp, MANIFEST), manifest)
        fsio.fsync_dir(tmp)
        final = self.step_folder(step)
        old = None
        # Replacing a step: the old folder moves aside first, and `_recover` restores it if a crash comes before the
        # new one is in place.
        if os.path.exists(final):
            old = os.path.join(self.root, f"{OLD_PREFIX}{step}_{secrets.token_hex(4)}")
            fsio.rename(final, old)
            fsio.fsync_dir(self.root)
        fsio.rename(tmp, final)
        fsio.fsync_dir(self.root)
        if old is not None:
            fsio.rmtree(old)
        if val_score is not None and math.isfinite(val_score):
            scores = self._read_scores()
            scores[str(step)] = float(val_score)
            fsio.write_json_atomic(os.path.join(self.root, SCORES), scores)
        tracker = os.path.join(self.root, TRACKER)
        # Written beside, then renamed over (os.replace is atomic): a reader sees the old step or the new one, never a
        # partial file.
        tracker_tmp = f"{tracker}.tmp.{os.getpid()}"
        fsio.write_bytes(tracker_tmp, f"{step}\n".encode())
        fsio.replace(tracker_tmp, tracker)
        fsio.fsync_dir(self.root)
        logger.info("saved checkpoint %s", final)
        self.prune()  # only now: the tracker names the new checkpoint, which prune always keeps
        return final

    # ------------------------------------------------------------------ pruning
    def _read_scores(self) -> dict[str, float]:
        path = os.path.join(self.root, SCORES)
        if not os.path.exists(path):
            return {}
        try:
            raw = fsio.read_json(path)
        except CheckpointError as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return {}
        if not isinstance(raw, dict):
            return {}
        return {str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float)) and math.isfinite(v)}

    def best_step(self) -> int | None:
        """The complete checkpoint with the best recorded validation score, if any."""
        scores = self._read_scores()
        candidates = [s for s in self.complete_steps() if str(s) in scores]
        if not candidates:
            return None
        sign = 1.0 if self.higher_is_better else -1.0
        return max(candidates, key=lambda s: (sign * scores[str(s)], s))  # a tie goes to the newest step

    def prune(self) -> list[int]:
        """Delete complete checkpoints beyond the newest `save_limit` (the best-scoring one is kept); returns them."""
        if self.save_limit == -1:
            return []
        steps = self.complete_steps()
        keep = set(steps[-self.save_limit :])
        best = self.best_step()
        if best is not None:
            keep.add(best)
        # The tracker's step too: after a resume from an older checkpoint it need not be among the highest.
        latest = self.latest()
        if latest is not None:
            keep.add(int(_STEP_RE.match(os.path.basename(latest)).group(1)))  # type: ignore[union-attr]
        removed = [s for s in steps if s not in keep]
        for step in removed:
            # Renamed to a hidden name first: a crash during the delete leaves trash for the next start, not a
            # half-deleted global_step_<N>.
            trash = os.path.join(self.root, f"{TRASH_PREFIX}{step}_{secrets.token_hex(4)}")
            fsio.rename(self.step_folder(step), trash)
            fsio.fsync_dir(self.root)
            fsio.rmtree(trash)
            logger.info("pruned checkpoint global_step_%d (save_limit=%d)", step, self.save_limit)
        if removed:
            scores = self._read_scores()
            if any(str(s) in scores for s in removed):
                kept = {k: v for k, v in scores.items() if int(k) not in removed}
                fsio.write_json_atomic(os.path.join(self.root, SCORES), kept)
        return removed

    # ------------------------------------------------------------------ finding
    def _tracked_step(self) -> int | None:
        path = os.path.join(self.root, TRACKER)
        if not os.path.lexists(path):
            return None
        try:
            # a step number: a FIFO, a device or a stray large file is refused, never read whole (or waited on)
            return int(fsio.read_regular(path, 64).decode("ascii").strip())
        except (OSError, ValueError, UnicodeDecodeError, CheckpointError) as exc:
            logger.warning("ignoring the checkpoint tracker %s (%s): using the newest complete checkpoint", path, exc)
            return None

    def latest(self, resumable_only: bool = False) -> str | None:
        """The newest complete checkpoint: the tracker's, else (missing or incomplete) the highest complete step."""
        check = is_resumable if resumable_only else is_complete
        tracked = self._tracked_step()
        if tracked is not None and check(self.step_folder(tracked)):
            return self.step_folder(tracked)
        for step in reversed(self.complete_steps()):
            if check(self.step_folder(step)):
                return self.step_folder(step)
        return None

    def resolve_load(
        self, load_checkpoint_path: str | None, find_last: bool, verify: bool = True, fallback: bool = False
    ) -> str | None:
        """The checkpoint to resume from, verified with :func:`verify_checkpoint` (`verify=False`: sizes and steps
        only, said in the log): the explicit path (must exist, be intact and resumable), else the newest resumable
        `global_step_*` when `find_last`, else None (a fresh start).

        A corrupt newest checkpoint stops the run naming it and the newest intact one; with `fallback` the run
        goes on from that older one instead (logged as an error naming both).
        """
        if not verify:
            logger.warning(
                "trainer.verify_checkpoint=false: checkpoint checksums are not verified before resuming "
                "(file sizes and steps still are)"
            )
        if load_checkpoint_path:
            path = os.path.abspath(load_checkpoint_path)
            if not os.path.isdir(path):
                raise CheckpointError(f"trainer.load_checkpoint_path {path} does not exist")
            try:
                verify_checkpoint(path, checksums=verify)
            except CheckpointError as exc:
                raise CheckpointError(f"trainer.load_checkpoint_path {path} cannot be resumed: {exc}") from exc
            if not is_resumable(path):
                raise CheckpointError(
                    f"trainer.load_checkpoint_path {path} has no trainer state (saved with save_model_only) and "
                    f"cannot be resumed; use `easyrl merge` on it and train from the merged model instead"
                )
            return path
        return self._newest_intact(verify, fallback) if find_last else None

    def _newest_intact(self, verify: bool, fallback: bool) -> str | None:
        """The newest resumable checkpoint that passes verification (see `resolve_load` for a corrupt one)."""
        # Every global_step_<N> folder, complete or not: an incomplete newest one is reported as corrupt, not skipped.
        steps = sorted((int(m.group(1)) for e in os.listdir(self.root) if (m := _STEP_RE.match(e))), reverse=True)
        corrupt: list[tuple[str, CheckpointError]] = []
        for step in steps:
            folder = self.step_folder(step)
            manifest = read_manifest(folder)
            if manifest is not None and not manifest.get("resumable"):
                continue  # saved with save_model_only: not a resume point, whatever its state
            try:
                verify_checkpoint(folder, checksums=verify)
            except CheckpointError as exc:
                corrupt.append((folder, exc))
                continue
            if corrupt:
                newest, error = corrupt[0]
                if not fallback:
                    raise CheckpointError(
                        f"the newest checkpoint {newest} is corrupt: {error}. The newest intact one is {folder}: "
                        f"set trainer.fallback_to_older_checkpoint=true to resume from it (or "
                        f"trainer.load_checkpoint_path={folder}), or move the corrupt folder away"
                    )
                for bad, bad_error in corrupt:
                    logger.error("checkpoint %s is corrupt: %s", bad, bad_error)
                logger.error(
                    "resuming from the older checkpoint %s instead of the corrupt %s "
                    "(trainer.fallback_to_older_checkpoint=true)",
                    folder,
                    newest,
                )
            return folder
        if corrupt:
            newest, error = corrupt[0]
            raise CheckpointError(f"the newest checkpoint {newest} is corrupt and no older one is intact: {error}")
        return None
