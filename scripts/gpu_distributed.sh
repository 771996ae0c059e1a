#!/usr/bin/env bash
# Two-GPU runs of issues 18 and 40 on nvidia-h200-x2 (NCCL), results under $OUT:
#
#   bash scripts/gpu_distributed.sh [STEP ...]     (from the repo root, .whl carried)
#
# One run per device call (a call has 10 minutes): STEP_TIMEOUT=540 bash ... tp_mtp, and so
# on. At most 3 steps per call: a call brings back 8 files (the log, distributed.json, and
# each step's dist_STEP.json and .rc_STEP). No STEP: tp dp.
#
# Issue 18 (regression checks), dsv32-small-dist, STEPS=1000 loop steps (REQUESTS=N: N
# requests instead of the config's 600):
#   tp         TP = 2, CUDA graphs, plan digests all-gathered after every forward -> dist_tp.json
#   dp         DP attention = 2, CUDA graphs (the FFN's NCCL all-gather captured in them),
#              planner debug (every replay checked against eager), requests split in
#              blocks so each rank idles for stretches                    -> dist_dp.json
# Issue 40 (speculative decoding on several ranks), dsv32-small-dist with SPEC_REQUESTS=200
# requests (arrivals end at loop step 319, every request ends by about step 450) and a cap
# of SPEC_STEPS=600 loop steps, DRAFT_TOKENS=4 rows per verify (the last token + 3 drafts):
#   tp_mtp     TP = 2, MTP draft, digests after every forward, drafts' too -> dist_tp_mtp.json
#   tp_ngram   TP = 2, n-gram draft, digests                               -> dist_tp_ngram.json
#   dp_mtp     DP attention = 2, MTP draft, debug, blocks: idle ranks replay verify- and
#              draft-shaped IDLE batches                                   -> dist_dp_mtp.json
#   dp_ngram   DP attention = 2, n-gram draft, debug, blocks               -> dist_dp_ngram.json
#   ref_mtp    one GPU, TP = 1 (one plain process, no torchrun): tp_mtp's workload and
#              flags without --tp, the reference tp_mtp's tokens are compared with
#                                                                          -> dist_ref_mtp.json
#   ref_ngram  the same for tp_ngram                                       -> dist_ref_ngram.json
# The several-rank runs are launched by torchrun (one process per GPU). Then distributed.json
# says, per run, whether it finished (0 hangs: a stalled collective fails after
# distributed.timeout_s), the mismatch counts (a digest or replay mismatch raises, so a
# finished run has 0), the cross-rank agreements, tokens/s per rank and in all, and, when
# dist_ref_DRAFT.json is there too, how many requests' tokens TP = 2 and TP = 1 share (in
# bf16 they need not: reported, not required). Exit status 0 only when every check holds.
#
# CPU_DRY_RUN=1 runs the same steps on this machine's CPU (gloo under torchrun, dsv32-tiny,
# a few requests, no wheels, no nvidia-smi): a check of the script and the judge, not of GPUs.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
: "${OUT:?set OUT to the results folder}"
if [ "${CPU_DRY_RUN:-0}" = 1 ]; then
    CONFIG="${CONFIG:-dsv32-tiny}"
    STEPS="${STEPS:-60}"
    REQUESTS="${REQUESTS:-16}"
    SPEC_REQUESTS="${SPEC_REQUESTS:-6}"
    SPEC_STEPS="${SPEC_STEPS:-40}"
    # spread arrivals and short answers: under --dp-split blocks both ranks idle
    EXTRA="${EXTRA:---device cpu --set loop.arrival_rate=0.25 --set loop.max_new_tokens=[8,16]}"
else
    source scripts/device_prelude.sh || exit 1
fi
LOG="$OUT/log_distributed.txt"
STEP_TIMEOUT="${STEP_TIMEOUT:-540}"
STEPS="${STEPS:-1000}"
SPEC_REQUESTS="${SPEC_REQUESTS:-200}"
SPEC_STEPS="${SPEC_STEPS:-600}"
DRAFT_TOKENS="${DRAFT_TOKENS:-4}"
CONFIG="${CONFIG:-dsv32-small-dist}"
read -r -a extra <<<"${EXTRA:-}"
base=(--max-steps "$STEPS")
[ -z "${REQUESTS:-}" ] || base+=(--requests "$REQUESTS")
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(tp dp)

# run NAME COMMAND...: one step under the step timeout, its exit status in .rc_NAME
run() {
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    echo "$rc" >"$OUT/.rc_$name"
}

# two ranks under torchrun (NCCL on GPUs, gloo on the CPU), rank 0 writing dist_NAME.json
launch() {
    local name=$1
    shift
    run "$name" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m planner decode --config "$CONFIG" --quiet ${extra[@]+"${extra[@]}"} "$@" --json "$OUT/dist_$name.json"
}

# one process, one GPU (TP = 1): the reference of a TP = 2 run
single() {
    local name=$1
    shift
    run "$name" python3 -m planner decode --config "$CONFIG" --quiet ${extra[@]+"${extra[@]}"} "$@" \
        --json "$OUT/dist_$name.json"
}

spec() { echo --draft "$1" --draft-tokens "$DRAFT_TOKENS" --requests "$SPEC_REQUESTS" --max-steps "$SPEC_STEPS"; }

for step in "${steps[@]}"; do
    case "$step" in
    tp | dp | tp_mtp | tp_ngram | dp_mtp | dp_ngram | ref_mtp | ref_ngram) ;;
    *) echo "unknown step $step" | tee -a "$LOG"; exit 2 ;;
    esac
done
[ "${CPU_DRY_RUN:-0}" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG" 2>&1
for step in "${steps[@]}"; do
    case "$step" in
    tp) launch tp "${base[@]}" --tp 2 --digests ;;
    dp) launch dp "${base[@]}" --dp-attention 2 --dp-split blocks --debug ;;
    tp_*) launch "$step" --tp 2 --digests $(spec "${step#tp_}") ;;
    dp_*) launch "$step" --dp-attention 2 --dp-split blocks --debug $(spec "${step#dp_}") ;;
    ref_*) single "$step" $(spec "${step#ref_}") ;;
    esac
done
python3 -m benchmarks check_distributed --out "$OUT" --steps "$STEPS" \
    --requests "$SPEC_REQUESTS" --spec-steps "$SPEC_STEPS" "${steps[@]}" | tee -a "$LOG"
