#!/usr/bin/env bash
# The GPU acceptance (issue #16, with what #5, #9 and #10 left to measure) in 3 stages, one device call each (< 10 min).
#
# On the device machine, after the 3 `bash .gpu-bundle/stash.sh` calls of `python3 ../shared/tools/gpu_bundle.py
# prepare` (vLLM 0.26 + Ray + our pure-Python deps), run one stage per call:
#
#   bash scripts/gpu_checks.sh tests_small   # the GPU-marked tests; Qwen2.5-0.5B shape S, 3 measured steps + raw vLLM
#   bash scripts/gpu_checks.sh mid           # Qwen2.5-1.5B shape S, 3 measured steps, raw vLLM in the same run
#   bash scripts/gpu_checks.sh large         # Qwen2.5-3B with adamw_bf16; Qwen2.5-VL-3B with images
#
# Extra stages, outside the acceptance: ab (each lever off in turn on 0.5B), vl_video, overhead (easyrl's rollout vs
# raw vLLM on one engine), lora (issue #20: LoRA step time and memory, the two rollout sync modes), sp (issue #21:
# Ulysses peak memory per rank; needs 2 or more GPUs) and cpu_smoke (this script's machinery on a CPU machine).
#
# Every run is bounded by its own timeout so a stage stays inside its call; a run that crashes or times out says
# so in the stage's summary table (printed last), and its log is kept. Logs and JSON summaries land in $OUT
# (default ./gpu_out) for docs/benchmarks.md.
set -uo pipefail

STAGE=${1:?usage: gpu_checks.sh tests_small|mid|large|ab|vl_video|overhead|lora|sp|cpu_smoke}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
BENCH=/tmp/easyrl_bench
RUNS=()

{
  echo "== $(date -u +%FT%TZ) stage $STAGE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "$PY" -c 'import torch, transformers, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'
} 2>&1 | tee -a "$OUT/versions.txt"

run() {  # run NAME SECONDS SUMMARY_GLOB CMD...: one bounded run; its status, log and newest summary under $OUT
  local name=$1 limit=$2 glob=$3
  shift 3
  RUNS+=("$name")
  local marker
  marker=$(mktemp)
  echo "== $name (at most ${limit} s): $*"
  timeout --kill-after=20 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) echo ok >"$OUT/$name.status" ;;
    124 | 137) echo "timed out after ${limit} s" >"$OUT/$name.status" ;;
    *) echo "crashed or failed (exit $rc): $(grep -E 'Error|error:' "$OUT/$name.log" | tail -1 | cut -c1-160)" >"$OUT/$name.status" ;;
  esac
  grep -v " INFO \| DEBUG " "$OUT/$name.log" | tail -25
  rm -f "$OUT/$name.json"
  local summary
  summary=$(find $glob -name summary.json -newer "$marker" 2>/dev/null | head -1)
  [ -n "$summary" ] && cp "$summary" "$OUT/$name.json"
  rm -f "$marker"
}

bench() {  # bench NAME SECONDS ARGS...: scripts/benchmark.py, shape S
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" "$BENCH" "$PY" scripts/benchmark.py --workdir "$BENCH" "$@"
}

vl() {  # vl NAME SECONDS MEDIA ARGS...: scripts/bench_vl.py, Qwen2.5-VL-3B shape
  local name=$1 limit=$2 media=$3
  shift 3
  run "$name" "$limit" /tmp/easyrl_bench_vl "$PY" scripts/bench_vl.py --media "$media" --workdir /tmp/easyrl_bench_vl "$@"
}

case "$STAGE" in
  tests_small)  # the budgets add up to 9.5 minutes: a run that needs more is cut and says so in the table
    run gpu_tests 300 /nonexistent "$PY" -m pytest -q -rfs -m gpu tests
    tail -5 "$OUT/gpu_tests.log"
    bench bench_0.5b 270 --model 0.5b --warmup 1 --steps 3
    ;;
  mid)
    bench bench_1.5b 570 --model 1.5b --warmup 1 --steps 3
    ;;
  large)
    bench bench_3b_adamw_bf16 310 --model 3b --optim adamw_bf16 --warmup 1 --steps 2 --no-raw-vllm
    vl vl_3b_images 250 image --warmup 1 --steps 2
    ;;
  ab)  # one lever off at a time (the defaults have all three on)
    bench ab_no_padding_free 180 --model 0.5b --warmup 1 --steps 2 --no-padding-free --no-raw-vllm
    bench ab_no_dynamic 180 --model 0.5b --warmup 1 --steps 2 --no-dynamic-batching --no-raw-vllm
    bench ab_no_fused 180 --model 0.5b --warmup 1 --steps 2 --no-fused-logprobs --no-raw-vllm
    ;;
  vl_video)
    vl vl_3b_video 560 video --warmup 1 --steps 2
    ;;
  lora)  # LoRA rank 8 on 0.5B and 1.5B (compare with tests_small / mid), then merged vs adapter sync on the 0.5B shape
    bench lora_0.5b 200 --model 0.5b --lora-rank 8 --warmup 1 --steps 2 --no-raw-vllm
    bench lora_1.5b 230 --model 1.5b --lora-rank 8 --warmup 1 --steps 2 --no-raw-vllm
    for mode in merged adapter; do  # one engine per process
      run "lora_sync_$mode" 75 /nonexistent "$PY" scripts/bench_lora_sync.py --modes "$mode" --hidden 896 --layers 24 \
        --heads 14 --kv-heads 2 --intermediate 4864 --rank 16 --updates 3 --prompts 64 --max-tokens 256
    done
    ;;
  sp)  # Ulysses on K GPUs (nccl; torch's varlen flash kernel under the all-to-alls): peak memory per rank vs K = 1
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -lt 2 ]; then
      echo "stage sp needs 2 or more GPUs, this machine has $gpus" >&2
      exit 2
    fi
    run sp_0.5b_16k 560 /nonexistent "$PY" scripts/bench_ulysses.py --model 0.5b --response 16384 --ulysses 2
    ;;
  cpu_smoke)  # the script's own machinery on a CPU machine, before device time is spent on it
    bench smoke_tiny 600 --tiny --steps 1 --warmup 0
    run smoke_crash 60 /nonexistent "$PY" -c 'raise RuntimeError("a run that crashes")'
    ;;
  overhead)
    run overhead 560 /nonexistent "$PY" scripts/bench_rollout_overhead.py --hidden 896 --layers 24 --heads 14 \
      --kv-heads 2 --intermediate 4864 --vocab 151936 --prompts 128 --n 8 --prompt-len 256 --max-tokens 512 \
      --repeats 2 --workdir /tmp/easyrl_overhead
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac

echo "== stage $STAGE summary"
"$PY" scripts/gpu_table.py "$OUT" "${RUNS[@]}" | tee "$OUT/$STAGE.table.md"
