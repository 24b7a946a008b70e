"""`easyrl merge` never replaces or mixes with what training wrote, and says what makes a folder no checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from easyrl.checkpoint import CheckpointError
from easyrl.checkpoint.manager import MANIFEST, is_complete
from easyrl.merge import MERGE_MARKER, merge_checkpoint
from easyrl.merge import main as merge_main
from tests.checkpoint.test_ckpt_safety import checkpoint  # noqa: F401  (module-scoped fixture)


@pytest.fixture
def run(checkpoint: dict[str, Any], tmp_path: Path) -> Path:  # noqa: F811
    """A copy of a real run folder: run/global_step_1 (complete), plus a tracker file written by training."""
    root = tmp_path / "run"
    shutil.copytree(checkpoint["folder"], root / "global_step_1")
    (root / "experiment_log.jsonl").write_text('{"step": 1}\n')
    return root


@pytest.mark.parametrize("where", ["run", "step", "role", "parent", "inside_run", "inside_step"])
def test_output_over_the_run_is_refused_even_with_overwrite(run: Path, where: str) -> None:
    step = run / "global_step_1"
    output = {
        "run": run,
        "step": step,
        "role": step / "actor",
        "parent": run.parent,
        "inside_run": run / "merged",
        "inside_step": step / "merged",
    }[where]
    before = sorted(str(p.relative_to(run.parent)) for p in run.parent.rglob("*"))
    assert merge_main([str(step), "--output", str(output), "--overwrite"]) == 1
    with pytest.raises(CheckpointError, match="--output"):
        merge_checkpoint(str(step), str(output), overwrite=True)
    assert sorted(str(p.relative_to(run.parent)) for p in run.parent.rglob("*")) == before, "the run was touched"
    assert is_complete(str(step)) and (run / "experiment_log.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_replaces_only_a_previous_merge_output(run: Path, tmp_path: Path) -> None:
    step = str(run / "global_step_1")
    out = tmp_path / "merged"
    assert merge_checkpoint(step, str(out)) == str(out)
    assert json.loads((out / MERGE_MARKER).read_text())["source"] == os.path.join(step, "actor")
    with pytest.raises(CheckpointError, match="already exists"):
        merge_checkpoint(step, str(out))
    assert merge_checkpoint(step, str(out), overwrite=True) == str(out)  # a merge output: replaced
    mine = tmp_path / "my_models"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"not an easyrl merge output.*{MERGE_MARKER}"):
        merge_checkpoint(step, str(mine), overwrite=True)
    assert (mine / "keep.txt").read_text() == "mine"


def test_default_output_inside_the_checkpoint_is_allowed(run: Path) -> None:
    out = merge_checkpoint(str(run / "global_step_1"))
    assert out == str(run / "global_step_1" / "actor" / "huggingface_merged") and os.path.isfile(
        os.path.join(out, MERGE_MARKER)
    )


def test_merge_says_what_makes_a_folder_no_checkpoint(run: Path, tmp_path: Path) -> None:
    plain = tmp_path / "some_model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"no {MANIFEST} manifest, so it is not a checkpoint written by"):
        merge_checkpoint(str(plain), str(tmp_path / "out"))
    step = run / "global_step_1"
    (step / "actor" / "model_rank0_of1.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"actor/model_rank0_of1\.safetensors is missing \(listed in .*COMPLETE\)"
    ):
        merge_checkpoint(str(step), str(tmp_path / "out"))


def test_role_is_a_plain_name(run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36: `--role` with a path read a folder that was never verified, so a corrupt checkpoint that a direct
    merge refuses was merged through it. Now a role is a plain folder name, one line otherwise."""
    corrupt = tmp_path / "elsewhere" / "global_step_1"
    shutil.copytree(run / "global_step_1", corrupt)
    shard = corrupt / "actor" / "model_rank0_of1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8:] = b"\xff" * 8  # same size, other bytes: only the checksum sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model_rank0_of1"):
        merge_checkpoint(str(corrupt), str(tmp_path / "direct"))
    step = str(run / "global_step_1")
    for role in (str(corrupt / "actor"), "../../elsewhere/global_step_1/actor", "actor/..", "..", ".", ""):
        caplog.clear()
        assert merge_main([step, "--role", role, "-o", str(tmp_path / "out")]) == 1, role
        lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(lines) == 1 and f"--role {role!r} is not a role name" in lines[0], lines
        assert not (tmp_path / "out").exists()
    os.symlink(corrupt / "actor", run / "global_step_1" / "linked")  # a plain name that leads out of the checkpoint
    caplog.clear()
    assert merge_main([step, "--role", "linked", "-o", str(tmp_path / "out")]) == 1
    assert "linked is a link out of" in caplog.text and not (tmp_path / "out").exists()
