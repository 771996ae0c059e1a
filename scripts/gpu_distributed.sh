#!/usr/bin/env bash
# Two-GPU runs of issue 18 on nvidia-h200-x2 (NCCL), results under $OUT:
#
#   bash scripts/gpu_distributed.sh [tp] [dp]      (from the repo root, .whl carried)
#
# One run per device call (a call has 10 minutes): STEP_TIMEOUT=540 bash ... tp, then ... dp.
#
#   tp  dsv32-small, TP = 2, CUDA graphs, plan digests all-gathered after every forward,
#       1,000 loop steps                                        -> dist_tp.json
#   dp  dsv32-small, DP attention = 2, CUDA graphs (the FFN's NCCL all-gather captured in
#       them), planner debug (every replay checked against eager), requests split in
#       blocks so each rank idles for stretches, 1,000 loop steps -> dist_dp.json
# Both are launched by torchrun (one process per GPU). Then distributed.json says, per run,
# whether it finished (0 hangs: a stalled collective fails after distributed.timeout_s),
# the mismatch counts (a digest or replay mismatch raises, so a finished run has 0) and
# the cross-rank agreements; the exit status is 0 only when every check holds.
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
: "${OUT:?set OUT to the results folder}"
LOG="$OUT/log_distributed.txt"
STEP_TIMEOUT="${STEP_TIMEOUT:-540}"
STEPS="${STEPS:-1000}"
CONFIG=dsv32-small-dist
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(tp dp)

launch() {
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m planner decode --config "$CONFIG" --quiet --max-steps "$STEPS" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    echo "$rc" >"$OUT/.rc_$name"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG" 2>&1
for step in "${steps[@]}"; do
    case "$step" in
    tp) launch tp --tp 2 --digests --json "$OUT/dist_tp.json" ;;
    dp) launch dp --dp-attention 2 --dp-split blocks --debug --json "$OUT/dist_dp.json" ;;
    *) echo "unknown step $step" | tee -a "$LOG"; exit 2 ;;
    esac
done
python3 -m benchmarks.check_distributed --out "$OUT" --steps "$STEPS" "${steps[@]}" | tee -a "$LOG"
