#!/usr/bin/env bash
# Issue 14's host-cost benchmarks on an older commit and on the work tree, side by side in
# one device call (the host's speed drifts between calls, so only a comparison inside one
# call means anything), results packed into $OUT/old_new.tar.gz with the log beside it.
#
#   git archive REV | tar -x -C .old          (here, before the call; .old is git-ignored)
#   bash scripts/gpu_old_new.sh [STEP...]      (on the H200, repo root, carry .whl and .old)
#
# Steps (default: gpu_tests pieces refresh po decode, in this order). The old and the new
# tree alternate inside each of those (old, new, new, old for the repeated ones). The work
# tree alone: suite (the whole GPU suite), refresh_new, po_new, and decode_pinned (the
# decode loop, unpinned and pinned to one core by taskset, alternating, DECODE_ROUNDS
# rounds). Each command is bounded by STEP_TIMEOUT seconds (default 120); stopped from
# outside (a `timeout` around the whole script), it still packs what ran. The old tree is
# needed only by the steps that run it.
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
T="${STEP_TIMEOUT:-120}"
R="$OUT/old_new"
NEW="$PWD"
OLD="$PWD/.old"
mkdir -p "$R"
LOG="$OUT/log.txt"
need_old() {
    [[ -d "$OLD/planner" ]] || { echo "no old tree in $OLD (git archive REV | tar -x -C .old)" >&2; exit 1; }
}

pack() {  # also when a timeout stops the script: what ran so far comes back
    tar -C "$OUT" -czf "$OUT/old_new.tar.gz" old_new && rm -rf "$R"
    ls -la "$OUT"
}
trap 'exit 143' TERM
trap pack EXIT

run_in() {  # run_in TREE NAME CMD...: CMD from TREE's root, TREE first on the path
    local tree=$1 name=$2
    shift 2
    echo "=== $name ($tree): $*" | tee -a "$LOG"
    local start=$SECONDS
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$T" "$@") >"$R/$name.txt" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$LOG"
}

gpu_tests() {
    run_in "$NEW" gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_flashinfer_gpu.py \
        tests/gpu/test_nsa_flashinfer_gpu.py tests/gpu/test_cuda_events_gpu.py
}
pieces() {
    run_in "$NEW" pieces python3 -m benchmarks.replay_pieces --out "$R/pieces.json" \
        --plot "$R/pieces.png"
}
refresh() {
    need_old
    local r tree
    for r in 1 2; do
        for tree in old new; do
            [[ $r == 2 ]] && tree=$([[ $tree == old ]] && echo new || echo old)
            local dir=$([[ $tree == old ]] && echo "$OLD" || echo "$NEW")
            run_in "$dir" "refresh_${tree}_r$r" python3 benchmarks/replay_overhead.py \
                --iters 300 --batches 1 8 64 256 --out "$R/refresh_${tree}_r$r.json"
        done
    done
}
po() {
    need_old
    run_in "$OLD" po_old python3 -m benchmarks.planner_overhead --runs 1 --iters 300 \
        --out "$R/po_old.json"
    run_in "$NEW" po_new python3 -m benchmarks.planner_overhead --runs 1 --iters 300 \
        --out "$R/po_new.json" --plot "$R/planner_overhead.png"
}
decode() {  # DECODE_ROUNDS rounds (default 1) of old, new, new, old
    need_old
    local tree
    for tree in $(for _ in $(seq "${DECODE_ROUNDS:-1}"); do echo old new new old; done); do
        local dir=$([[ $tree == old ]] && echo "$OLD" || echo "$NEW")
        local n=1
        while [[ -e "$R/small_${tree}_$n.json" ]]; do n=$((n + 1)); done
        run_in "$dir" "small_${tree}_$n" python3 -m planner decode \
            --config configs/dsv32-small.yaml --requests 16 --quiet --json "$R/small_${tree}_$n.json"
    done
}

suite() {
    run_in "$NEW" suite python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=25 tests
}
refresh_new() {
    local r
    for r in 1 2; do
        run_in "$NEW" "refresh_new_r$r" python3 benchmarks/replay_overhead.py --iters 300 \
            --batches 1 8 64 256 --out "$R/refresh_new_r$r.json"
    done
}
po_new() {
    run_in "$NEW" po_new python3 -m benchmarks.planner_overhead --runs 2 --iters 300 \
        --out "$R/po_new.json" --plot "$R/planner_overhead.png"
}
decode_pinned() {  # the same loop unpinned and on one core, alternating
    local i
    for i in $(seq "${DECODE_ROUNDS:-1}"); do
        run_in "$NEW" "small_free_$i" python3 -m planner decode --config configs/dsv32-small.yaml \
            --requests 16 --quiet --json "$R/small_free_$i.json"
        run_in "$NEW" "small_pinned_$i" taskset -c 3 python3 -m planner decode \
            --config configs/dsv32-small.yaml --requests 16 --quiet --json "$R/small_pinned_$i.json"
    done
}

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(gpu_tests pieces refresh po decode)
for s in "${steps[@]}"; do "$s"; done
