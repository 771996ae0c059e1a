#!/usr/bin/env bash
# Run GPU verifications and measurements in one device call, results under $OUT.
#
#   bash scripts/gpu_verify.sh STEP...      (on the H200, from the repo root, .whl carried)
#
# Steps (each bounded by STEP_TIMEOUT seconds, default 300; one log, $OUT/log.txt, keeps
# everything printed, and each step's JSON lands in $OUT, so a device call returns at most
# a handful of files; GPU_MAXFAIL (default 3) bounds gpu_tests' failures, SEED_ITERS
# (default 20) the timed steps of each model_seed cell). Steps joined by "+" run side by
# side, each logging to $OUT/log_STEP.txt (correctness runs that share the GPU in one call,
# e.g. gpu_tests+invariance+arrivals_debug; never timings, which must run alone):
#   mqa         fp8_mqa_logits drop-in vs the real kernel         -> verify_mqa_logits.json
#   deepgemm    paged MQA schedule and logits vs the real kernel  -> verify_deepgemm.json
#   sparse_mla  Triton sparse MLA vs the reference and FlashInfer -> bench_sparse_mla.json
#   sparse_fi   FlashInfer sparse MLA via the nsa_flashinfer plan   -> sparse_flashinfer.json/.png
#   moe_topk    routed MoE and length-aware top-k                 -> bench_moe_topk.json
#   gpu_tests   pytest -m gpu over the whole tree (tests/gpu and the GPU cases elsewhere)
#   small       dsv32-small decode, 16 requests                   -> small.json
#   shapes      dsv32-shapes decode, 64 requests                  -> shapes.json
#   shapes_ragged  the same mixing under ragged graphs: KV capacity, capture time and
#               graph memory beside shapes' (issue 37; after it, never beside) -> shapes_ragged.json
#   small_fi, shapes_fi  the same with --mla-kernel flashinfer     -> small_fi.json, shapes_fi.json
#   floor       dsv32-shapes step under graphs vs its HBM floor   -> model_floor.json
#   step_profile dsv32-shapes step kernels by group (graph and eager) -> profile_step.json/.png
#   model_seed  whole dsv32-shapes model: per-layer vs once-per-batch schedule -> model_seed.json
#   model_seed_fi  the same with FlashInfer's sparse MLA plan     -> model_seed_fi.json
#   host        planner vs hand-written host time, every variant  -> planner_overhead.json/.png
#   refresh     graph runner refresh, decode and target verify    -> replay_overhead*.json
#   profile     host profile of replay, runner step, eager plan   -> profile_host.json
#   spec_verify expanded-row verify under graphs vs deep_gemm     -> verify_spec_verify.json
#   spec        dsv32-small speculative (MTP, n-gram) vs plain    -> spec_decode.json
#   ragged      mixed steps on dsv32-shapes, graph vs eager (issue 37) -> ragged.json/.png
#   arrivals    dsv32-small-arrivals, prefill-first vs mixed under ragged graphs
#               (timed, one after the other)                  -> arrivals_off.json, arrivals_on.json
#   arrivals_debug  the mixed run with --debug: every replay against a fresh plan
#                                                             -> arrivals_debug.json
#   invariance  batch-invariant mode: speculative, logits, chunks (issue 39)
#                                                             -> batch_invariance.json
#   invariance_speed  its speed beside the default mode    -> batch_invariance_speed.json/.png
#   dist        two GPUs (nvidia-h200-x2): TP=2 digests, DP attention=2 -> distributed.json
#               (scripts/gpu_distributed.sh; give it STEP_TIMEOUT=580; issue 40's speculative
#               runs, one call each, are that script's own steps: tp_mtp, dp_mtp, ...)
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
LOG="$OUT/log.txt"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
failed=0
MIXED=(--set graphs.ragged=true --set loop.mixed=true --set planner.ragged_kv_tokens=262144)
# mixed prefill and decode steps under ragged graphs, the KV bound sized to a loaded step

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
    mqa) run mqa python3 benchmarks/verify_mqa_logits.py --out "$OUT" ;;
    deepgemm) run deepgemm python3 benchmarks/verify_deepgemm.py --out "$OUT/verify_deepgemm.json" ;;
    sparse_mla) run sparse_mla python3 benchmarks/bench_sparse_mla.py --out "$OUT" --iters 50 ;;
    sparse_fi) run sparse_fi python3 -m benchmarks.verify_sparse_flashinfer \
        --out "$OUT/sparse_flashinfer.json" --plot "$OUT/sparse_flashinfer.png" ;;
    moe_topk) run moe_topk python3 benchmarks/bench_moe_topk.py --out "$OUT" --iters 30 ;;
    gpu_tests) run gpu_tests python3 -m pytest -q -p no:cacheprovider --maxfail="${GPU_MAXFAIL:-3}" -m gpu tests ;;
    small) run small python3 -m planner decode --config dsv32-small --requests 16 \
        --quiet --json "$OUT/small.json" ;;
    shapes) run shapes python3 -m planner decode --config dsv32-shapes --requests 64 \
        --quiet --json "$OUT/shapes.json" ;;
    shapes_ragged) run shapes_ragged python3 -m planner decode --config dsv32-shapes \
        --requests 64 --quiet --json "$OUT/shapes_ragged.json" "${MIXED[@]}" ;;
    small_fi) run small_fi python3 -m planner decode --config dsv32-small \
        --requests 16 --mla-kernel flashinfer --quiet --json "$OUT/small_fi.json" ;;
    shapes_fi) run shapes_fi python3 -m planner decode --config dsv32-shapes \
        --requests 64 --mla-kernel flashinfer --quiet --json "$OUT/shapes_fi.json" ;;
    floor) run floor python3 -m benchmarks.model_floor --out "$OUT/model_floor.json" ;;
    step_profile) run step_profile python3 -m benchmarks.profile_step --batches 1 64 \
        --out "$OUT/profile_step.json" --plot "$OUT/profile_step.png" ;;
    model_seed) run model_seed python3 benchmarks/seed_stack.py --stack model --contexts 4096 \
        --batches 1 16 64 --modes graph --runs 2 --warmup 5 --iters "${SEED_ITERS:-20}" --out "$OUT/model_seed.json" ;;
    model_seed_fi) run model_seed_fi python3 benchmarks/seed_stack.py --stack model \
        --contexts 4096 --batches 1 16 64 --modes graph --runs 2 --warmup 5 \
        --iters "${SEED_ITERS:-20}" --mla-kernel flashinfer --out "$OUT/model_seed_fi.json" ;;
    host) run host python3 -m benchmarks.planner_overhead --iters 300 \
        --out "$OUT/planner_overhead.json" --plot "$OUT/planner_overhead.png" ;;
    refresh)
        run refresh python3 benchmarks/replay_overhead.py --iters 300 --batches 1 64 256 \
            --out "$OUT/replay_overhead.json"
        run refresh_verify python3 benchmarks/replay_overhead.py --iters 300 --batches 1 64 256 \
            --mode target_verify --out "$OUT/replay_overhead_verify.json" ;;
    profile) run profile python3 -m benchmarks.profile_host --out "$OUT/profile_host.json" ;;
    spec_verify) run spec_verify python3 benchmarks/verify_spec_verify.py --out "$OUT" ;;
    spec) run spec python3 benchmarks/spec_decode.py --out "$OUT" ;;
    ragged) run ragged python3 -m benchmarks.ragged_steps --config dsv32-shapes \
        --out "$OUT/ragged.json" --plot "$OUT/ragged.png" ;;
    arrivals)
        run arrivals_off python3 -m planner decode --config dsv32-small-arrivals --quiet \
            --json "$OUT/arrivals_off.json"
        run arrivals_on python3 -m planner decode --config dsv32-small-arrivals --quiet \
            --json "$OUT/arrivals_on.json" "${MIXED[@]}" ;;
    arrivals_debug) run arrivals_debug python3 -m planner decode --config dsv32-small-arrivals \
        --requests 60 --debug --quiet --json "$OUT/arrivals_debug.json" "${MIXED[@]}" ;;
    invariance) run invariance python3 -m benchmarks.batch_invariance --parts spec,logits,chunks \
        --out "$OUT" ;;
    invariance_speed)
        mkdir -p "$OUT/speed"
        run invariance_speed python3 -m benchmarks.batch_invariance --parts speed \
            --out "$OUT/speed" --plot "$OUT/batch_invariance_speed.png"
        mv "$OUT/speed/batch_invariance.json" "$OUT/batch_invariance_speed.json" 2>/dev/null
        rmdir "$OUT/speed" 2>/dev/null ;;
    dist) run dist bash scripts/gpu_distributed.sh tp dp ;;
    *) echo "unknown step $step" | tee -a "$LOG"; failed=1 ;;
    esac
}

for step in "$@"; do
    if [[ $step == *+* ]]; then  # side by side, each with its own log: never for timings
        pids=()
        for part in ${step//+/ }; do
            (LOG="$OUT/log_$part.txt" failed=0; one "$part"; exit "$failed") &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    else
        one "$step"
    fi
done
exit "$failed"
