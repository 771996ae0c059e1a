#!/usr/bin/env bash
# The planner's host costs on an older commit and on the work tree, side by side in one device
# call (the host's speed drifts between calls, so only a comparison inside one call means
# anything); results packed into $OUT/old_new.tar.gz with the log beside it.
#
#   git archive REV | tar -x -C .old          (here, before the call; .old is git-ignored)
#   bash scripts/gpu_old_new.sh [STEP...]      (on the H200, repo root, carry .whl and .old)
#
# Steps (default: tests po refresh small). Each alternates the trees (old, new, new, old where
# it repeats), so a drift of the host falls on both:
#   tests     the GPU tests of what this tree changed (the work tree only)
#   graph_tests  of those, the graph and staging-pull tests alone
#   suite     the whole GPU suite (the work tree only)
#   po        benchmarks/planner_overhead.py (this tree's script, run in both trees): eager
#             plan() and replay() beside the hand-written paths, bs 1 8 64 256
#   refresh   benchmarks/replay_overhead.py (each tree's own): the graph runner's refresh
#   small     the decode loop, dsv32-small, 16 requests
#   shapes    the decode loop, dsv32-shapes (61 layers), 64 requests
#   arrivals  the decode loop under arrivals (configs/dsv32-small-arrivals.yaml), graphs on
#   eager     the same with --no-graphs: every decode step an eager plan
# Each command is bounded by STEP_TIMEOUT seconds (default 150); stopped from outside (a
# `timeout` around the whole script), it still packs what ran.
set -u
cd "$(dirname "$0")/.." || exit 1
source scripts/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
T="${STEP_TIMEOUT:-150}"
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
    tail -n 4 "$R/$name.txt" | tee -a "$LOG"
}

both() {  # both NAME ORDER CMD...: CMD in the trees in ORDER (e.g. "old new new old")
    local name=$1 order=$2
    shift 2
    need_old
    local tree n
    for tree in $order; do
        local dir=$([[ $tree == old ]] && echo "$OLD" || echo "$NEW")
        n=1
        while [[ -e "$R/${name}_${tree}_$n.txt" ]]; do n=$((n + 1)); done
        run_in "$dir" "${name}_${tree}_$n" "${@//@JSON@/$R/${name}_${tree}_$n.json}"
    done
}

tests() {
    run_in "$NEW" tests python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_staging_pull_gpu.py \
        tests/gpu/test_triton_launch_gpu.py tests/gpu/test_deepgemm_gpu.py \
        tests/gpu/test_flashinfer_gpu.py tests/gpu/test_nsa_flashinfer_gpu.py
}
graph_tests() {  # the tests of the staging paths alone
    run_in "$NEW" graph_tests python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_staging_pull_gpu.py
}
suite() {
    run_in "$NEW" suite python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=25 tests
}
po() {
    cp "$NEW/benchmarks/planner_overhead.py" "$OLD/benchmarks/planner_overhead.py"
    both po "new old" python3 -m benchmarks.planner_overhead --iters 300 --flashinfer \
        --out @JSON@
}
refresh() {
    both refresh "old new new old" python3 benchmarks/replay_overhead.py --iters 300 \
        --batches 1 8 64 256 --out @JSON@
}
small() {
    both small "${SMALL_ORDER:-old new new old}" python3 -m planner decode \
        --config dsv32-small \
        --requests 16 --quiet --json @JSON@
}
shapes() {
    both shapes "new old" python3 -m planner decode --config dsv32-shapes \
        --requests 64 --quiet --json @JSON@
}
arrivals() {
    both arrivals "old new" python3 -m planner decode \
        --config "$NEW/configs/dsv32-small-arrivals.yaml" --quiet --json @JSON@
}
eager() {
    both eager "new old" python3 -m planner decode \
        --config "$NEW/configs/dsv32-small-arrivals.yaml" --no-graphs --quiet --json @JSON@
}

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests po refresh small)
for s in "${steps[@]}"; do "$s"; done
