"""`easyrl merge` answers bad sizes and a full disk with one line, and every file it or a save writes has one mode,
the user's umask (issue 36)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from easyrl.checkpoint.fsio import current_umask
from easyrl.merge import main as merge_main
from easyrl.merge import merge_checkpoint
from tests.checkpoint.test_ckpt_safety import checkpoint  # noqa: F401  (module-scoped fixture: a real checkpoint)
from tests.conftest import REPO


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("size", ["nan", "inf", "-1", "0", "five"])
def test_bad_shard_size_is_one_line(
    checkpoint: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    size: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        merge_main([checkpoint["folder"], "--output", str(tmp_path / "out"), "--max-shard-size-gb", size])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--max-shard-size-gb: {size!r}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_merge_onto_a_full_disk_is_one_line_and_leaves_nothing(
    checkpoint: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """RLIMIT_FSIZE makes the kernel fail the first write past 4 KiB (EFBIG, as ENOSPC would on a full disk)."""
    out = tmp_path / "out"
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); from easyrl.merge import main; "
        f"sys.exit(main([{checkpoint['folder']!r}, '--output', {str(out)!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "writing the merged model failed" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert os.listdir(tmp_path) == [], "a half-written output was left behind"


def test_checkpoint_and_merged_files_share_the_umask_mode(
    checkpoint: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """safetensors files used to be 0600 beside 0644 JSON; now all are 0666 less the umask."""
    saved = _modes(Path(checkpoint["folder"]))
    assert any(name.endswith(".safetensors") for name in saved)
    assert set(saved.values()) == {0o666 & ~current_umask()}, saved
    old = os.umask(0o027)
    try:
        out = merge_checkpoint(checkpoint["folder"], str(tmp_path / "merged"))
    finally:
        os.umask(old)
    merged = _modes(Path(out))
    assert "model.safetensors" in merged and set(merged.values()) == {0o640}, merged
    shutil.rmtree(out)


def _forge_header(folder: Path, claim: dict[str, Any]) -> str:
    """Rewrite the first tensor's entry in the easyrl header of the shard file (its data untouched) and reseal the
    manifest, as a deliberate forger would; returns the tensor's name."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.checkpoint.test_ckpt_safety import reseal

    (shard,) = (folder / "actor").glob("model_rank*_of*.safetensors")
    tensors = load_file(str(shard))
    meta = fsio_metadata(shard)
    header = json.loads(meta["easyrl"])
    name = next(iter(header["tensors"]))
    header["tensors"][name].update(claim)
    save_file(tensors, str(shard), {**meta, "easyrl": json.dumps(header)})
    reseal(str(folder))
    return name


def fsio_metadata(path: Path) -> dict[str, str]:
    from easyrl.checkpoint.fsio import read_tensor_metadata

    return read_tensor_metadata(str(path))


@pytest.mark.parametrize(
    "claim",
    [
        {"global_shape": [1 << 40, 1 << 40], "shard_dim": 0, "offset": 0},
        {"global_shape": [1 << 20, 1 << 20], "shard_dim": None},
        {"global_shape": [-1, 4], "shard_dim": 0, "offset": 0},
        {"global_shape": [64, 32], "shard_dim": 5, "offset": 0},
        {"global_shape": "big"},
    ],
    ids=["sharded_4096_exabytes", "replicated_4_tib", "negative", "bad_dim", "not_a_shape"],
)
def test_a_shard_whose_header_claims_an_absurd_tensor_is_one_line(
    checkpoint: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    claim: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = tmp_path / "run"
    shutil.copytree(Path(checkpoint["folder"]).parent, run)
    folder = run / Path(checkpoint["folder"]).name
    name = _forge_header(folder, claim)
    assert merge_main([str(folder), "--output", str(tmp_path / "out")]) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("easyrl merge: ") and name in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()
