"""Driver-side checkpoints: commit/latest/resolve, pruning, and crash injection at every write boundary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from easyrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMixin,
    fsio,
    is_complete,
    read_trainer_state,
    write_trainer_state,
)
from easyrl.checkpoint.manager import MANIFEST, TRACKER
from easyrl.config import EasyRLConfig


class PlainWorker(CheckpointMixin):
    """An unsharded model + AdamW + LambdaLR in this process (rank 0 of 1), as a worker would hold them."""

    def __init__(self, model_dir: str) -> None:
        self.cfg = EasyRLConfig()
        self.cfg.worker.actor.model.model_path = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (s + 1))

    def step(self) -> None:
        ids = torch.randint(0, 90, (2, 8))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def save(manager: CheckpointManager, worker: PlainWorker, step: int, score: float | None = None, tag: int = 0) -> str:
    """One full save as the trainer does it; `tag` names the weights saved (`expected[tag]` in the tests)."""
    tmp = manager.begin(step)
    worker.save_checkpoint(os.path.join(tmp, "actor"), False)
    write_trainer_state(tmp, {"global_step": step, "tag": tag or step, "sampler": {"epoch": 0, "cursor": step}})
    return manager.commit(tmp, step, score)


def check_loads(folder: str, loader: PlainWorker, expected: dict[int, dict[str, torch.Tensor]]) -> int:
    """Load `folder` into `loader` and compare with the weights recorded for its tag; returns the tag."""
    state, rng = read_trainer_state(folder)
    tag = int(state["tag"])
    loader.load_checkpoint(os.path.join(folder, "actor"))
    for name, tensor in loader.weights().items():
        assert torch.equal(tensor, expected[tag][name]), (folder, name)
    assert "torch_cpu" in rng.tensors
    return tag


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from easyrl.testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("ckm") / "m", hidden_size=32, num_layers=1, intermediate_size=64
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> dict[str, Any]:
    """A root with complete checkpoints at steps 1 and 2, the worker that wrote them, and their weights."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ckm_root") / "run"
    manager = CheckpointManager(str(root), save_limit=2)
    worker = PlainWorker(model_dir)
    expected = {}
    for step in (1, 2):
        worker.step()
        expected[step] = worker.weights()
        save(manager, worker, step)
    worker.step()
    expected[3] = worker.weights()
    return {"root": root, "worker": worker, "expected": expected, "loader": PlainWorker(model_dir)}


def test_commit_layout_latest_and_resolve(base: dict[str, Any], tmp_path: Path, model_dir: str) -> None:
    root = tmp_path / "run"
    shutil.copytree(base["root"], root)
    manager = CheckpointManager(str(root), save_limit=-1)
    latest = manager.latest()
    assert latest == str(root / "global_step_2") and is_complete(latest)
    assert (root / TRACKER).read_text().strip() == "2"
    actor = root / "global_step_2" / "actor"
    for name in (
        "meta.json",
        "model_rank0_of1.safetensors",
        "optim_rank0_of1.safetensors",
        "optim_rank0.json",
        "scheduler.json",
        "rng_rank0.safetensors",
        "rng_rank0.json",
        "huggingface/config.json",
        "huggingface/generation_config.json",
        "huggingface/tokenizer.json",
    ):
        assert (actor / name).is_file(), name
    assert check_loads(latest, base["loader"], base["expected"]) == 2
    assert manager.resolve_load(None, find_last=True) == latest
    assert manager.resolve_load(None, find_last=False) is None
    assert manager.resolve_load(str(root / "global_step_1"), find_last=True) == str(root / "global_step_1")

    with pytest.raises(CheckpointError, match="does not exist"):
        manager.resolve_load(str(root / "global_step_9"), find_last=True)
    (root / "global_step_2" / "actor" / "optim_rank0.json").write_text("{}")  # size changes: incomplete
    with pytest.raises(CheckpointError, match=r"optim_rank0\.json is 2 bytes, the manifest records"):
        manager.resolve_load(str(root / "global_step_2"), find_last=True)
    # a damaged newest checkpoint is refused by name rather than skipped (tests/checkpoint/test_ckpt_integrity.py)
    with pytest.raises(CheckpointError, match="global_step_2 is corrupt"):
        manager.resolve_load(None, True)
    # the tracker points at an incomplete checkpoint, then goes missing: fall back to the newest complete one
    assert manager.latest() == str(root / "global_step_1")
    (root / TRACKER).unlink()
    assert manager.latest() == str(root / "global_step_1")
    (root / "global_step_1" / MANIFEST).unlink()
    assert manager.latest() is None


def test_model_only_checkpoint_is_not_resumable(base: dict[str, Any], tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "run"), save_limit=-1)
    tmp = manager.begin(4)
    base["worker"].save_checkpoint(os.path.join(tmp, "actor"), True)
    folder = manager.commit(tmp, 4)
    assert is_complete(folder) and manager.latest() == folder
    assert not os.path.exists(os.path.join(folder, "actor", "optim_rank0_of1.safetensors"))
    assert manager.resolve_load(None, find_last=True) is None
    with pytest.raises(CheckpointError, match="save_model_only"):
        manager.resolve_load(folder, find_last=False)


def test_pruning_keeps_newest_and_best(base: dict[str, Any], tmp_path: Path) -> None:
    worker = base["worker"]
    manager = CheckpointManager(str(tmp_path / "run"), save_limit=2)
    scores = {1: 0.2, 2: 0.9, 3: 0.1, 4: 0.3, 5: 0.4}
    for step, score in scores.items():
        save(manager, worker, step, score)
    assert manager.complete_steps() == [2, 4, 5]
    assert fsio.read_json(str(tmp_path / "run" / "checkpoint_scores.json")) == {"2": 0.9, "4": 0.3, "5": 0.4}
    keep_all = CheckpointManager(str(tmp_path / "all"), save_limit=-1)
    for step in range(1, 5):
        save(keep_all, worker, step)
    assert keep_all.complete_steps() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        CheckpointManager(str(tmp_path / "x"), save_limit=0)
    # saving a step that exists replaces it
    folder = save(keep_all, worker, 4)
    assert is_complete(folder) and keep_all.complete_steps() == [1, 2, 3, 4]


BOUNDARIES = (
    "makedirs",
    "save_tensors",
    "write_bytes",
    "copy_file",
    "fsync_file",
    "fsync_dir",
    "rename",
    "replace",
    "rmtree",
)


def _instrument(monkeypatch: pytest.MonkeyPatch, fail_at: int | None, mode: str) -> list[str]:
    """Wrap every fsio write boundary; the `fail_at`-th call raises before, after, or after tearing its file."""
    calls: list[str] = []
    for name in BOUNDARIES:
        original: Callable[..., Any] = getattr(fsio, name)

        def wrapper(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            hit = fail_at is not None and len(calls) == fail_at
            if hit and mode == "before":
                raise OSError(f"injected crash before {_name}")
            result = _original(*args, **kwargs)
            if hit:
                if mode == "torn" and _name in ("save_tensors", "write_bytes", "copy_file"):
                    path = args[1] if _name == "copy_file" else args[0]
                    with open(path, "r+b") as handle:
                        handle.truncate(os.path.getsize(path) // 2)
                raise OSError(f"injected crash after {_name}")
            return result

        monkeypatch.setattr(fsio, name, wrapper)
    return calls


@pytest.mark.parametrize("resave_step", [3, 2])
def test_crash_at_every_write_boundary(base: dict[str, Any], tmp_path: Path, resave_step: int) -> None:
    """Saving step 3 (new) or re-saving step 2 (replace) with save_limit=2 crashes at each boundary in turn."""
    worker, expected = base["worker"], base["expected"]
    clean = tmp_path / "clean"
    shutil.copytree(base["root"], clean)
    clean_manager = CheckpointManager(str(clean), save_limit=2)
    with pytest.MonkeyPatch.context() as mp:
        calls = _instrument(mp, None, "before")
        save(clean_manager, worker, resave_step, tag=3)
    total = len(calls)
    assert total > 20 and {"rename", "replace", "save_tensors", "write_bytes", "rmtree"} <= set(calls)
    # A crash after boundary k is a crash before k + 1, so "after" only adds the last one; "torn" also
    # truncates the file a write boundary has just written.
    cases = [("before", k) for k in range(1, total + 1)] + [("after", total)]
    cases += [("torn", k) for k in range(1, total + 1) if calls[k - 1] in ("save_tensors", "write_bytes", "copy_file")]
    outcomes = set()
    for mode, k in cases:
        root = tmp_path / f"{mode}_{k}"
        shutil.copytree(base["root"], root)
        manager = CheckpointManager(str(root), save_limit=2)
        with pytest.MonkeyPatch.context() as mp:
            _instrument(mp, k, mode)
            with pytest.raises(OSError, match="injected crash"):
                save(manager, worker, resave_step, tag=3)
        restarted = CheckpointManager(str(root), save_limit=2)
        assert not [e for e in os.listdir(root) if e.startswith(".")], (mode, k)
        latest = restarted.latest(resumable_only=True)
        assert latest is not None and is_complete(latest), (mode, k)
        outcomes.add(check_loads(latest, base["loader"], expected))
        shutil.rmtree(root)
    assert outcomes == {2, 3}  # crashes before publishing keep the old state, later ones the new


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    sys.path.insert(0, {here!r})
    from easyrl.checkpoint import CheckpointManager, fsio
    from test_ckpt_manager import PlainWorker, save

    worker = PlainWorker({model_dir!r})
    worker.load_checkpoint(os.path.join({root!r}, "global_step_2", "actor"))
    worker.step()
    original = fsio.replace
    def die(src, dst):
        if dst.endswith("latest_checkpointed_iteration.txt"):
            os.kill(os.getpid(), signal.SIGKILL)
        original(src, dst)
    fsio.replace = die
    save(CheckpointManager({root!r}, save_limit=2), worker, 3)
    """
)


def test_killed_process_leaves_a_loadable_checkpoint(base: dict[str, Any], tmp_path: Path, model_dir: str) -> None:
    root = tmp_path / "run"
    shutil.copytree(base["root"], root)
    script = KILL_SCRIPT.format(here=str(Path(__file__).parent), model_dir=model_dir, root=str(root))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert (root / TRACKER).read_text().strip() == "2"  # killed before the tracker moved
    manager = CheckpointManager(str(root), save_limit=2)
    latest = manager.latest(resumable_only=True)
    assert latest == str(root / "global_step_2")
    assert check_loads(latest, base["loader"], base["expected"]) == 2
    assert is_complete(str(root / "global_step_3"))  # published, just not tracked yet
