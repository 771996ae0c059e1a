#!/usr/bin/env bash
# Run GPU verifications and measurements in one device call, results under $OUT.
#
#   bash scripts/gpu_verify.sh STEP...      (on the H200, from the repo root, .whl carried)
#
# A step is a benchmark's name: `python -m benchmarks` lists them, by group, a line each. Step
# NAME runs `python3 -m benchmarks NAME` with the arguments its line in `one` below gives it,
# its JSON (and plot, where it has one) under $OUT. One step is not a benchmark: gpu_tests,
# pytest -m gpu over the whole tree (tests/gpu and the GPU cases elsewhere; GPU_MAXFAIL,
# default 3, bounds its failures). NAME:VARIANT runs another of a benchmark's runs:
#   decode_runs:CASES       the decode CLI's cases, comma-separated (decode_runs alone: small,
#                           shapes; `python -m benchmarks decode_runs --help` names them all)
#   seed_stack:fi           the whole model with FlashInfer's sparse MLA plan -> model_seed_fi.json
#   batch_invariance:speed  the invariant mode's speed beside the default's
#                           -> batch_invariance_speed.json/.png
# check_distributed takes two GPUs (nvidia-h200-x2): scripts/gpu_distributed.sh tp dp, whose
# judge it is (give it STEP_TIMEOUT=580; issue 40's speculative runs, one call each, are that
# script's own steps: tp_mtp, dp_mtp, ...).
#
# Each command is bounded by STEP_TIMEOUT seconds (default 300); one log, $OUT/log.txt, keeps
# everything printed, and each step's JSON lands in $OUT, so a device call returns at most a
# handful of files; SEED_ITERS (default 20) bounds the timed steps of each seed_stack cell.
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
    # The planner's host cost
    planner_overhead) run "$step" python3 -m benchmarks planner_overhead --iters 300 \
        --out "$OUT/planner_overhead.json" --plot "$OUT/planner_overhead.png" ;;
    replay_overhead)  # decode, then target verify
        run "$step" python3 -m benchmarks replay_overhead --iters 300 --batches 1 64 256 \
            --out "$OUT/replay_overhead.json"
        run "$step:verify" python3 -m benchmarks replay_overhead --iters 300 --batches 1 64 256 \
            --mode target_verify --out "$OUT/replay_overhead_verify.json" ;;
    eager_pieces) run "$step" python3 -m benchmarks eager_pieces --out "$OUT/eager_pieces.json" \
        --plot "$OUT/eager_pieces.png" ;;
    replay_pieces) run "$step" python3 -m benchmarks replay_pieces --out "$OUT/replay_pieces.json" \
        --plot "$OUT/replay_pieces.png" ;;
    profile_host) run "$step" python3 -m benchmarks profile_host --out "$OUT/profile_host.json" ;;
    device_check) run "$step" python3 -m benchmarks device_check --out "$OUT/device_check.json" ;;
    ragged_replay) run "$step" python3 -m benchmarks ragged_replay --out "$OUT/ragged_replay.json" ;;
    debug_cost) run "$step" python3 -m benchmarks debug_cost --configs small --steps 600 \
        --out "$OUT/debug_cost.json" ;;
    # The serving loop
    decode_runs) run "$step" python3 -m benchmarks decode_runs --cases small,shapes --out "$OUT" ;;
    decode_runs:*) run "$step" python3 -m benchmarks decode_runs --cases "${step#*:}" --out "$OUT" ;;
    overlap_loop) run "$step" python3 -m benchmarks overlap_loop --out "$OUT/overlap_loop.json" \
        --plot "$OUT/overlap_loop.png" ;;
    spec_decode) run "$step" python3 -m benchmarks spec_decode --out "$OUT" ;;
    ragged_steps) run "$step" python3 -m benchmarks ragged_steps --config dsv32-shapes \
        --out "$OUT/ragged.json" --plot "$OUT/ragged.png" ;;
    batch_invariance) run "$step" python3 -m benchmarks batch_invariance \
        --parts spec,logits,chunks --out "$OUT" ;;
    batch_invariance:speed)
        mkdir -p "$OUT/speed"
        run "$step" python3 -m benchmarks batch_invariance --parts speed \
            --out "$OUT/speed" --plot "$OUT/batch_invariance_speed.png"
        mv "$OUT/speed/batch_invariance.json" "$OUT/batch_invariance_speed.json" 2>/dev/null
        rmdir "$OUT/speed" 2>/dev/null ;;
    check_distributed) run "$step" bash scripts/gpu_distributed.sh tp dp ;;
    # Kernels against their floors
    model_floor) run "$step" python3 -m benchmarks model_floor --out "$OUT/model_floor.json" ;;
    profile_step) run "$step" python3 -m benchmarks profile_step --batches 1 64 \
        --out "$OUT/profile_step.json" --plot "$OUT/profile_step.png" ;;
    seed_stack) run "$step" python3 -m benchmarks seed_stack --stack model --contexts 4096 \
        --batches 1 16 64 --modes graph --runs 2 --warmup 5 --iters "${SEED_ITERS:-20}" \
        --out "$OUT/model_seed.json" ;;
    seed_stack:fi) run "$step" python3 -m benchmarks seed_stack --stack model --contexts 4096 \
        --batches 1 16 64 --modes graph --runs 2 --warmup 5 --iters "${SEED_ITERS:-20}" \
        --mla-kernel flashinfer --out "$OUT/model_seed_fi.json" ;;
    sparse_mla) run "$step" python3 -m benchmarks sparse_mla --out "$OUT" --iters 50 ;;
    moe_topk) run "$step" python3 -m benchmarks moe_topk --out "$OUT" --iters 30 ;;
    row_topk_latency) run "$step" python3 -m benchmarks row_topk_latency \
        --out "$OUT/row_topk_latency.json" ;;
    weights_proj_gemm) run "$step" python3 -m benchmarks weights_proj_gemm \
        --out "$OUT/weights_proj_gemm.json" --plot "$OUT/weights_proj_gemm.png" ;;
    invariant_gemm) run "$step" python3 -m benchmarks invariant_gemm --out "$OUT/invariant_gemm.json" ;;
    # GPU verification against the real libraries
    deepgemm) run "$step" python3 -m benchmarks deepgemm --out "$OUT/verify_deepgemm.json" ;;
    flashinfer) run "$step" python3 -m benchmarks flashinfer --out "$OUT/verify_flashinfer.json" ;;
    mqa_logits) run "$step" python3 -m benchmarks mqa_logits --out "$OUT" ;;
    sparse_flashinfer) run "$step" python3 -m benchmarks sparse_flashinfer \
        --out "$OUT/sparse_flashinfer.json" --plot "$OUT/sparse_flashinfer.png" ;;
    spec_verify) run "$step" python3 -m benchmarks spec_verify --out "$OUT" ;;
    # Soaks
    soak_gpu) run "$step" python3 -m benchmarks soak_gpu --out "$OUT/soak_gpu.json" ;;
    *) echo "unknown step $step (python -m benchmarks lists the benchmarks)" | tee -a "$LOG"; failed=1 ;;
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
