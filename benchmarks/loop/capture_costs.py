"""What each shipped GPU config's CUDA graphs cost at start-up: count, seconds, pool, KV.

Each case runs the decode CLI three times in fresh processes, one after the other: a first
start with the defaults (its kernels compile and the disk caches keep them: what a config's
first start on a machine costs), then, measured against each other, the defaults again (on
CUDA: decode graphs, and ragged token-bucket graphs for prompt chunks and mixed steps) and
decode graphs only (``graphs.ragged=false``, ``loop.mixed=false``: the defaults before issue
55), both with warm compile caches, as a restarted server starts. One request, one loop
step: the graphs are captured when the engine starts, so the run is the start-up. Reported
per run: the target's graphs, its capture seconds split into the planner's capture plans,
the eager warm-up runs and the recording (``graph_capture_costs``), the graph pool's bytes
(allocated: the graphs' live outputs; reserved: what the pool holds, intermediates included)
and the KV cache's tokens; per case, the defaults' capture seconds and reserved pool as
multiples of the decode-only run's (issue 55's bound: 2x). A speculating config's draft
graphs are captured too but not counted here.

Cases (``--cases``; default all): ``small``, ``arrivals`` (dsv32-small-arrivals), ``spec``
(dsv32-small-spec, its plain comparison off), ``shapes`` (dsv32-shapes, 61 layers) and
``seed`` (dsv32-shapes at ``planner.max_batch=16``, the seed-like workload's engine).

    python3 -m benchmarks capture_costs --out "$OUT"                  # every case, the GPU
    python3 -m benchmarks capture_costs --cases seed --out "$OUT"
    python3 -m benchmarks capture_costs --case 'tiny=dsv32-tiny' --extra='--device cpu'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import machine, plot_bars, print_table, write_json
from benchmarks.loop.decode_runs import OFF, add_case_arguments, chosen_cases, results_dir
from benchmarks.loop.overlap_loop import (
    Runner,
    command,
    run_decode,
    run_process,
)

GPU_STEPS = {
    "": "--out {out} --plot {out}/capture_costs.png",
    "*": "--cases {variant} --out {out}",
}

START = ["--requests", "1", "--max-steps", "1"]
"""One request, one step: the run is the engine's start-up (its capture) and no more."""
CASES: dict[str, tuple[str, list[str]]] = {
    "small": ("dsv32-small", []),
    "arrivals": ("dsv32-small-arrivals", []),
    "spec": ("dsv32-small-spec", ["--set", "speculative.compare_plain=false"]),
    "shapes": ("dsv32-shapes", []),
    "seed": ("dsv32-shapes", ["--set", "planner.max_batch=16"]),
}
"""Each case: name -> (config, its own arguments to the decode CLI)."""
VARIANTS = {"first_start": [], "defaults": [], "decode_only": OFF}
"""Each case runs these in order: the defaults on cold compile caches, the defaults again and
decode graphs only; the ratios compare the last two."""
PHASES = ("plan_seconds", "warmup_seconds", "record_seconds")
"""The parts of a graph's capture (``GraphStats.capture_costs``), summed over its graphs."""


def read_capture(payload: dict[str, Any]) -> dict[str, Any]:
    """What a run's ``--json`` summary says of its graphs: their count (by mode), capture
    seconds (in all, and by phase summed over the graphs), pool bytes and KV tokens."""
    s = payload["summary"]
    costs: dict[str, dict[str, Any]] = s.get("graph_capture_costs") or {}
    modes: dict[str, int] = {}
    for label in costs:
        mode = label.split("/")[0]
        modes[mode] = modes.get(mode, 0) + 1
    return {
        "graphs": len(costs),
        "graphs_by_mode": modes,
        "capture_seconds": s.get("graph_capture_seconds"),
        **{phase: sum(c.get(phase) or 0.0 for c in costs.values()) for phase in PHASES},
        "pool_bytes": s.get("graph_pool_bytes"),
        "pool_reserved_bytes": s.get("graph_pool_reserved_bytes"),
        "kv_tokens": s.get("kv_tokens_capacity"),
        "costs": costs,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_cases(
    names: Sequence[str],
    cases: dict[str, tuple[str, list[str]]],
    out: Path,
    args: argparse.Namespace,
    extra: Sequence[str],
    runner: Runner,
) -> dict[str, dict[str, Any]]:
    """Each case's two runs, in order; a run that fails is kept as its failure."""
    results: dict[str, dict[str, Any]] = {}
    total = len(names) * len(VARIANTS)
    k = 0
    for name in names:
        config, case_args = cases[name]
        runs: dict[str, Any] = {}
        for variant, variant_args in VARIANTS.items():
            k += 1
            print(f"[{k}/{total}] {name} {variant}", file=sys.stderr, flush=True)
            path = out / f"{name}-{variant}.json"
            cmd = command(config, [*START, *case_args, *variant_args], None, path, 0, extra)
            payload, failure = run_decode(cmd, path, runner, args.timeout, args.tail, name)
            runs[variant] = {
                "command": cmd,
                "capture": None if payload is None else read_capture(payload),
                "failure": failure,
            }
        on, off = (runs[v]["capture"] or {} for v in ("defaults", "decode_only"))
        results[name] = {
            "config": config,
            "runs": runs,
            "seconds_ratio": ratio(on.get("capture_seconds"), off.get("capture_seconds")),
            "pool_ratio": ratio(on.get("pool_reserved_bytes"), off.get("pool_reserved_bytes")),
            "kv_ratio": ratio(on.get("kv_tokens"), off.get("kv_tokens")),
        }
    return results


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table_rows(results: dict[str, dict[str, Any]]) -> list[tuple]:
    rows = []
    for name, result in results.items():
        for variant, run in result["runs"].items():
            c = run["capture"]
            if c is None:
                rows.append((name, variant, *["-"] * 8, f"FAILED (exit {run['failure']['exit']})"))
                continue
            cells = (c["graphs"], c["capture_seconds"], *(c[p] for p in PHASES))
            pools = _mb(c["pool_bytes"]), _mb(c["pool_reserved_bytes"])
            rows.append((name, variant, *cells, *pools, c["kv_tokens"], "ok"))
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        rows.append(
            (name, "ratio", "", fmt(result["seconds_ratio"]), "", "", "", "")
            + (fmt(result["pool_ratio"]), fmt(result["kv_ratio"]), "")
        )
    return rows


def main(argv: Sequence[str] | None = None, runner: Runner = run_process) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(p, list(CASES), "all")
    p.add_argument("--out", help="folder for each run's JSON and capture_costs.json")
    p.add_argument("--plot", help="write a PNG of capture seconds per case here")
    args = p.parse_args(argv)
    names, cases, extra = chosen_cases(p, args, CASES, list(CASES), groups={})
    with results_dir(args.out, "capture_costs-") as out:
        results = run_cases(names, cases, out, args, extra, runner)
    header = ("case", "graphs of", "count", "capture s", "plan s", "warm-up s", "record s")
    header += ("pool MB", "reserved MB", "KV tokens", "status")
    table = print_table("graph capture at start-up", header, table_rows(results))
    seconds = {
        v: [(r["runs"][v]["capture"] or {}).get("capture_seconds") or 0.0 for r in results.values()]
        for v in VARIANTS
    }
    plot_bars(args.plot, "graph capture at start-up", list(results), seconds, "seconds")
    if args.out:
        payload = {"machine": machine(), "args": vars(args), "table": table, "cases": results}
        write_json(str(Path(args.out) / "capture_costs.json"), payload)
    failed = any(run["failure"] for r in results.values() for run in r["runs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
