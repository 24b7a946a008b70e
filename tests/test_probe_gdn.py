"""`scripts/probe_gdn.py`, the GPU probe of vLLM's Gated DeltaNet prefill kernels: without CUDA it says so in one line,
runs nothing and exits 0; its failure lines name the exception chain and where it was raised."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_refuses_without_cuda_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "probe_gdn.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "probe_gdn: no CUDA device here; this probe runs vLLM's GDN prefill kernels on a GPU: nothing run"
    ]


def test_a_failure_names_its_causes_and_where() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from probe_gdn import _describe
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def first_prefill() -> None:
        raise ModuleNotFoundError("No module named 'flashinfer'")

    try:
        try:
            first_prefill()
        except ModuleNotFoundError as exc:
            raise RuntimeError("EngineCore failed") from exc
    except RuntimeError as exc:
        line = _describe(exc)
    assert line.startswith("RuntimeError: EngineCore failed <- caused by ModuleNotFoundError: No module named")
    assert "| at test_probe_gdn.py:" in line and "first_prefill" in line and "\n" not in line
