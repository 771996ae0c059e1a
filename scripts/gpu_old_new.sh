#!/usr/bin/env bash
# The planner's host costs on an older commit and on the work tree, side by side in one device
# call (the host's speed drifts between calls, so only a comparison inside one call means
# anything); results packed into $OUT/old_new.tar.gz with the log beside it.
#
#   git archive REV | tar -x -C .old && echo REV > .old/REV   (here, before the call; .old
#                                              is git-ignored: carry it; REV names it in the log)
#   bash scripts/gpu_old_new.sh [STEP...]      (on the H200, repo root, carry .whl and .old)
#
# Steps (default: tests po refresh small). Each alternates the trees (old, new, new, old where
# it repeats), so a drift of the host falls on both:
#   tests     the GPU tests of what this tree changed (the work tree only)
#   graph_tests  of those, the graph and staging-pull tests alone
#   suite     the whole GPU suite (the work tree only)
#   check     the device_check benchmark: the device check's GPU time (the work tree only)
#   po        the planner_overhead benchmark (this tree's script, run in both trees; the old
#             tree's own where it fails this one, as it does in a tree from before
#             benchmarks/ had groups): eager plan() and replay() beside the hand-written
#             paths, bs 1 8 64 256
#   refresh   the replay_overhead benchmark (each tree's own): the graph runner's refresh
#   small     the decode loop, dsv32-small, 16 requests
#   shapes    the decode loop, dsv32-shapes (61 layers), 64 requests
#   arrivals  the decode loop under arrivals (configs/dsv32-small-arrivals.yaml), graphs on
#   mixed     the same with mixing under ragged graphs (MIXED below: extend and mixed replays)
#   eager     the same with --no-graphs: every decode step an eager plan
# A step named STEP:TREE,TREE,... runs in that order instead of its own (small:new,old), so
# a call can alternate rounds: refresh:old,new po small:old,new ... small:new,old.
# A benchmark runs as `python3 -m benchmarks NAME` in either tree (in a tree from before the
# suite, benchmarks/NAME.py, as `python3 -m benchmarks.NAME`).
# Each command is bounded by STEP_TIMEOUT seconds (default 150); with BUDGET=S, by what is
# left of S seconds from the script's start too, and a run is skipped (its .txt says so)
# once less than MIN_LEFT (default 45) is left. Stopped from outside (a `timeout` around the
# whole script), it still packs what ran. The pack holds every run's .txt and .json; beside
# it $OUT/summary.txt, the old and new figures side by side (scripts/old_new_summary.py).
set -u
cd "$(dirname "$0")/.." || exit 1
# installed already when the device command sourced the prelude itself (saves a reinstall)
if [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* || ! -d /tmp/site/forward_planner-0.0.dist-info ]]; then
    source scripts/device_prelude.sh || exit 1
fi
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
T="${STEP_TIMEOUT:-150}"
B="${BUDGET:-0}"
# mixed prefill and decode steps under ragged graphs, the KV bound sized to a loaded step
MIXED=(--set graphs.ragged=true --set loop.mixed=true --set planner.ragged_kv_tokens=262144)
R="$OUT/old_new"
NEW="$PWD"
OLD="$PWD/.old"
mkdir -p "$R"
LOG="$OUT/log.txt"
need_old() {
    [[ -d "$OLD/planner" ]] || { echo "no old tree in $OLD (git archive REV | tar -x -C .old)" >&2; exit 1; }
}

pack() {  # also when a timeout stops the script: what ran so far comes back
    { cat "$R/machine.txt" 2>/dev/null; python3 "$NEW/scripts/old_new_summary.py" "$R" 2>&1; } \
        >"$OUT/summary.txt"
    cp "$OUT/summary.txt" "$R/summary.txt"
    tar -C "$OUT" -czf "$OUT/old_new.tar.gz" old_new && rm -rf "$R"
    ls -la "$OUT"
    cat "$OUT/summary.txt"
}
trap 'exit 143' TERM
trap pack EXIT

run_in() {  # run_in TREE NAME CMD...: CMD from TREE's root, TREE first on the path
    local tree=$1 name=$2 t=$T
    shift 2
    if [[ $1 == python3 && $2 == -m && $3 == benchmarks && ! -e $tree/benchmarks/__main__.py ]]; then
        set -- python3 -m "benchmarks.$4" "${@:5}"  # a tree from before the suite: flat modules
    fi
    if ((B > 0)); then  # within the budget: skip what cannot run, cut what would overrun
        local left=$((B - SECONDS))
        if ((left < ${MIN_LEFT:-45})); then
            echo "skipped: $left s of BUDGET=$B left" | tee "$R/$name.txt" | sed "s/^/=== $name: /" | tee -a "$LOG"
            return
        fi
        ((left - 5 < t)) && t=$((left - 5))
    fi
    echo "=== $name ($tree, limit $t s): $*" | tee -a "$LOG"
    local start=$SECONDS
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout -k 10 "$t" "$@") >"$R/$name.txt" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s (at $SECONDS s)" | tee -a "$LOG"
    tail -n 4 "$R/$name.txt" | tee -a "$LOG"
}

both() {  # both NAME ORDER CMD...: CMD in the trees in ORDER (e.g. "old new new old"), or
    # in the order the step was named with (STEP_ORDER)
    local name=$1 order=${STEP_ORDER:-$2}
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
graph_tests() {  # the tests of the staging paths and the device check alone
    run_in "$NEW" graph_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_staging_pull_gpu.py \
        tests/planner/test_device_check_triton.py tests/planner/test_bad_input_catalogue.py
}
check() {  # the device check's GPU time in a graph, beside the planner's record and the floor
    run_in "$NEW" device_check python3 -m benchmarks device_check --out "$R/device_check.json"
}
suite() {
    run_in "$NEW" suite python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=25 tests
}
po() {
    need_old
    local script="$OLD/benchmarks/host/planner_overhead.py"
    [[ -e $script ]] || script="$OLD/benchmarks/planner_overhead.py"  # before the suite
    local own="$script.own"
    [[ -e $own ]] || cp "$script" "$own"
    cp "$NEW/benchmarks/host/planner_overhead.py" "$script"
    both po "new old" python3 -m benchmarks planner_overhead --iters 300 --flashinfer \
        --out @JSON@
    # an old tree that refused this tree's script (an API it lacks) runs its own instead
    if ! cmp -s "$own" "$script" && ls "$R"/po_old_*.txt >/dev/null 2>&1 \
        && ! ls "$R"/po_old_*.json >/dev/null 2>&1; then
        echo "=== po: the old tree failed this tree's script; its own instead" | tee -a "$LOG"
        cp "$own" "$script"
        STEP_ORDER=old both po "old" python3 -m benchmarks planner_overhead --iters 300 \
            --flashinfer --out @JSON@
    fi
}
refresh() {
    both refresh "old new new old" python3 -m benchmarks replay_overhead --iters 300 \
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
mixed() {
    both mixed "new old" python3 -m planner decode \
        --config "$NEW/configs/dsv32-small-arrivals.yaml" --quiet --json @JSON@ "${MIXED[@]}"
}
eager() {
    both eager "new old" python3 -m planner decode \
        --config "$NEW/configs/dsv32-small-arrivals.yaml" --no-graphs --quiet --json @JSON@
}

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests po refresh small)
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    echo "host: $(nproc) cores; old tree: $(cat "$OLD/REV" 2>/dev/null || echo '?'); steps: ${steps[*]}"
} | tee "$R/machine.txt" | tee -a "$LOG"
for s in "${steps[@]}"; do
    order=""
    [[ $s == *:* ]] && order=${s#*:} && order=${order//,/ }
    STEP_ORDER=$order "${s%%:*}"
done
