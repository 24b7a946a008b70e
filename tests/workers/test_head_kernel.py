"""`worker.actor.fused_head_kernel` (torch | triton): the Triton head's CPU cases run in Triton's interpreter in a
process of their own (tests/workers/head_kernel_cases.py: the interpreter must be on before triton is first
imported), and the config refuses the switch where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from easyrl.config import load_config
from easyrl.config.errors import ConfigError
from tests.conftest import base_config, write_config


REPO = Path(__file__).resolve().parents[2]
KEY = "worker.actor.fused_head_kernel"


def test_triton_head_cases_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/workers/head_kernel_cases.py"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail


def test_the_config_refuses_triton_on_cpu_and_without_the_fused_head(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    path = write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    with pytest.raises(ConfigError, match=rf"^{KEY}: the Triton head runs on CUDA only and trainer.device is cpu"):
        load_config(path, [f"{KEY}=triton", "worker.actor.fused_logprobs=true"])
    with pytest.raises(ConfigError, match=rf"^{KEY}: triton is a kernel of the fused head and fused_logprobs is"):
        load_config(path, [f"{KEY}=triton", "worker.actor.fused_logprobs=false", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match=rf"^{KEY}: 'cuda' is not allowed; choose one of: torch, triton$"):
        load_config(path, [f"{KEY}=cuda"])
    fused = [f"{KEY}=triton", "worker.actor.fused_logprobs=true", "trainer.device=cuda"]
    assert load_config(path, fused).worker.actor.fused_head_kernel == "triton"
