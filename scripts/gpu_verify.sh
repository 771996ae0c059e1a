#!/usr/bin/env bash
# Run GPU verifications and measurements in one device call, results under $OUT.
#
#   bash scripts/gpu_verify.sh STEP...      (on the H200, from the repo root, .whl carried)
#
# A step is a benchmark's name: `python -m benchmarks` lists them, by group, a line each. Step
# NAME (or NAME:VARIANT) runs `python3 -m benchmarks step NAME --out $OUT`: the arguments are
# the benchmark's own, declared beside its code (its GPU_STEPS: `python -m benchmarks step
# NAME --out DIR --dry-run` prints them), e.g. decode_runs:arrivals,shapes_off (the decode
# CLI's cases; decode_runs alone: small, shapes), seed_stack:fi, batch_invariance:speed,
# replay_overhead:verify, overlap_loop:small16,small64. Two steps are not a benchmark's run:
# gpu_tests, pytest -m gpu over the whole tree (tests/gpu and the GPU cases elsewhere;
# GPU_MAXFAIL, default 3, bounds its failures), and check_distributed on two GPUs
# (nvidia-h200-x2): scripts/gpu_distributed.sh tp dp, whose judge it is (give it
# STEP_TIMEOUT=580; issue 40's speculative runs, one call each, are that script's own steps).
#
# Each command is bounded by STEP_TIMEOUT seconds (default 300); one log, $OUT/log.txt, keeps
# everything printed, and each step's JSON lands in $OUT, so a device call returns at most a
# handful of files.
# Steps joined by "+" run side by side, each logging to $OUT/log_STEP.txt (correctness runs
# that share the GPU in one call, e.g. gpu_tests+batch_invariance+decode_runs:arrivals_debug;
# never timings, which must run alone).
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
LOG="$OUT/log.txt"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
failed=0

run() {
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || failed=1
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >>"$LOG" 2>&1

one() {
    local step=$1
    case "$step" in
    gpu_tests) run gpu_tests python3 -m pytest -q -p no:cacheprovider --maxfail="${GPU_MAXFAIL:-3}" -m gpu tests ;;
    check_distributed) run "$step" bash scripts/gpu_distributed.sh tp dp ;;  # two GPUs; it judges
    *) run "$step" python3 -m benchmarks step "$step" --out "$OUT" ;;  # the benchmark's GPU_STEPS
    esac
}

for step in "$@"; do
    if [[ $step == *+* ]]; then  # side by side, each with its own log: never for timings
        pids=()
        for part in ${step//+/ }; do
            (LOG="$OUT/log_${part//[:,]/_}.txt" failed=0; one "$part"; exit "$failed") &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    else
        one "$step"
    fi
done
exit "$failed"
