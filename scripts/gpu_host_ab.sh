#!/usr/bin/env bash
# Issue 14's host-cost benchmarks with the compiled staging screen on and off, side by side
# in one device call (FORWARD_PLANNER_NATIVE=1 / 0, alternating), results packed into
# $OUT/host_ab.tar.gz (a device call returns at most 8 files) with the logs beside it.
#
#   bash scripts/gpu_host_ab.sh            (on the H200, from the repo root, .whl carried)
#
# Each command is bounded by STEP_TIMEOUT seconds (default 60); stopped from outside (a
# `timeout` around the whole script), it still packs what ran.
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
T="${STEP_TIMEOUT:-60}"
R="$OUT/ab"
mkdir -p "$R"
LOG="$OUT/log.txt"

pack() {  # also when a timeout stops the script: what ran so far comes back
    tar -C "$OUT" -czf "$OUT/host_ab.tar.gz" ab && rm -rf "$R"
    ls -la "$OUT"
}
trap 'exit 143' TERM
trap pack EXIT

step() {
    local name=$1 native=$2
    shift 2
    echo "=== $name (native $native): $*" | tee -a "$LOG"
    local start=$SECONDS
    FORWARD_PLANNER_NATIVE=$native timeout "$T" "$@" >"$R/$name.txt" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$LOG"
}

for r in 1 2; do
    for n in 1 0; do
        step "refresh_n${n}_r$r" "$n" python3 benchmarks/replay_overhead.py --iters 300 \
            --batches 1 8 64 256 --out "$R/refresh_n${n}_r$r.json"
    done
done
for n in 1 0; do
    step "verify_n$n" "$n" python3 benchmarks/replay_overhead.py --iters 300 \
        --batches 1 8 64 256 --mode target_verify --out "$R/verify_n$n.json"
done
step po_n1 1 python3 -m benchmarks.planner_overhead --runs 2 --iters 300 \
    --out "$R/po_n1.json" --plot "$OUT/planner_overhead.png"
step po_n0 0 python3 -m benchmarks.planner_overhead --runs 1 --iters 300 --out "$R/po_n0.json"
for n in 1 0; do
    step "small_n$n" "$n" python3 -m planner decode --config configs/dsv32-small.yaml \
        --requests 16 --quiet --json "$R/small_n$n.json"
done
step shapes 1 python3 -m planner decode --config configs/dsv32-shapes.yaml --requests 64 \
    --quiet --json "$R/shapes.json"
step profile_64 1 python3 -m benchmarks.profile_host --batch 64 --top 15 --out "$R/profile_64.json"
step profile_256 1 python3 -m benchmarks.profile_host --batch 256 --top 15 \
    --out "$R/profile_256.json"
