#!/usr/bin/env bash
# The GPU checks of issues #5, #9 and #10, in stages that each fit one device call (10 minutes at most).
#
# On the device machine, after the 3 `bash .gpu-bundle/stash.sh` calls of `python3 ../shared/tools/gpu_bundle.py
# prepare` (vLLM 0.26 + Ray + our pure-Python deps), run one stage per call:
#
#   bash scripts/gpu_checks.sh tests      # the GPU-marked tests (VL through the real vLLM engine, ...)
#   bash scripts/gpu_checks.sh bench15    # Qwen2.5-1.5B, shape S, all levers on, raw vLLM in the same run
#   bash scripts/gpu_checks.sh ab1        # packed-attention layouts, A/B on Qwen2.5-0.5B: all levers, each off...
#   bash scripts/gpu_checks.sh ab2        # ...continued: fused head off, CUDA graphs off, sleep level 1
#   bash scripts/gpu_checks.sh sizes      # Qwen2.5-0.5B and 3B, shape S
#   bash scripts/gpu_checks.sh vl         # Qwen2.5-VL-3B through vLLM with images, memory step by step
#   bash scripts/gpu_checks.sh vl_video   # ...with videos (needs PyAV: carried by the bundle from the local env)
#   bash scripts/gpu_checks.sh overhead   # easyrl's vLLM rollout vs raw vLLM on one engine (Qwen2.5-0.5B shape)
#
# Every stage writes its log and summaries under $OUT (default: ./gpu_out) for docs/benchmarks.md.
set -uo pipefail

STAGE=${1:?usage: gpu_checks.sh tests|bench15|ab1|ab2|sizes|vl|vl_video|overhead}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

{
  echo "== $(date -u +%FT%TZ) stage $STAGE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, transformers, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'
} 2>&1 | tee -a "$OUT/versions.txt"

bench() {  # bench NAME ARGS...: one benchmark run, its summary kept as $OUT/NAME.json
  local name=$1
  shift
  "$PY" scripts/benchmark.py --workdir /tmp/easyrl_bench "$@" 2>&1 | tee "$OUT/$name.log" | grep -v " INFO \| DEBUG "
  cp "$(ls -t /tmp/easyrl_bench/run_*/summary.json | head -1)" "$OUT/$name.json" 2>/dev/null || echo "$name: no summary"
}

LEVERS=(--padding-free --dynamic-batching --fused-logprobs)
case "$STAGE" in
  tests)
    "$PY" -m pytest -q -rfs -m gpu tests \
      2>&1 | tee "$OUT/tests.log" | tail -40
    ;;
  bench15)
    bench bench15_levers --model 1.5b "${LEVERS[@]}" --sleep-level 2
    ;;
  ab1)
    "$PY" scripts/bench_packed_attention.py --device cuda --dtype bf16 --hidden 1536 --layers 4 --heads 12 \
      --seqs 32 --len 768 2>&1 | tee "$OUT/packed_attention.log"
    bench ab_all --model 0.5b --steps 4 "${LEVERS[@]}" --no-raw-vllm
    bench ab_no_padding_free --model 0.5b --steps 4 --dynamic-batching --fused-logprobs --no-raw-vllm
    bench ab_no_dynamic --model 0.5b --steps 4 --padding-free --fused-logprobs --no-raw-vllm
    ;;
  ab2)
    bench ab_no_fused --model 0.5b --steps 4 --padding-free --dynamic-batching --no-raw-vllm
    bench ab_eager --model 0.5b --steps 4 "${LEVERS[@]}" --enforce-eager --no-raw-vllm
    bench ab_sleep1 --model 0.5b --steps 4 "${LEVERS[@]}" --sleep-level 1 --no-raw-vllm
    ;;
  sizes)
    bench size_0.5b --model 0.5b "${LEVERS[@]}" --sleep-level 2
    bench size_3b --model 3b "${LEVERS[@]}" --sleep-level 2 --optim adamw_bf16
    ;;
  vl | vl_video)
    media=image
    [ "$STAGE" = vl_video ] && media=video
    "$PY" scripts/bench_vl.py --media "$media" --workdir /tmp/easyrl_bench_vl 2>&1 | tee "$OUT/$STAGE.log" |
      grep -v " INFO \| DEBUG "
    cp "$(ls -t /tmp/easyrl_bench_vl/run_3b_"$media"_*/summary.json | head -1)" "$OUT/$STAGE.json" 2>/dev/null ||
      echo "$STAGE: no summary"
    ;;
  overhead)
    "$PY" scripts/bench_rollout_overhead.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 \
      --vocab 151936 --prompts 128 --n 8 --prompt-len 256 --max-tokens 512 --repeats 2 \
      --workdir /tmp/easyrl_overhead 2>&1 | tee "$OUT/overhead.log" | grep -v " INFO \| DEBUG "
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
