#!/usr/bin/env python3
"""What debug mode costs: decode step time with and without ``PLANNER_DEBUG=1``.

Debug mode (``PLANNER_DEBUG=1``, ``--debug``, ``planner.debug: true``) re-plans every
replayed batch eagerly and compares it bit for bit (``Planner.verify``: a fresh eager
plan, host copies of every field, a padding check) and checksums plans around eager
forwards (``Planner.guard``). This runs the decode engine twice over the same seeded
workload, once with the variable unset and once with it set, and reports per decode step
the median and mean wall time, the verify time the graph runner measured, and per eager
(prefill) step the mean time (where the guard's checksums land).

CPU (always): the tiny config, emulated graphs. CUDA (when present): dsv32-small, real
CUDA graphs and deep_gemm where installed. A decode step includes the model forward and
the host sync of sampling, so the ratio is what serving would see::

    python3 -m benchmarks debug_cost                      # CPU tiny (+ small on a GPU)
    python3 -m benchmarks debug_cost --configs small --steps 600 --out "$OUT/debug_cost.json"

CPU numbers depend on machine load (the output records the load average): compare the
two columns of one run, not runs on different machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from graphs import GraphWarning

GPU_STEPS = {
    "": "--configs small --steps 600 --out {out}/debug_cost.json",
}

CONFIGS = {
    "tiny": (
        "dsv32-tiny.yaml",
        {
            "loop.arrival_rate": 0.5,
            "loop.prompt_len": [2, 8],
            "loop.max_new_tokens": [8, 40],
            "planner.max_batch": 8,
            "planner.max_context": 128,
        },
        3.6,  # decode steps per request, measured for this workload
    ),
    "small": (
        "dsv32-small.yaml",
        {
            "loop.arrival_rate": 1.0,
            "loop.prompt_len": [8, 64],
            "loop.max_new_tokens": [64, 192],
            "planner.max_batch": 64,
            "planner.max_context": 512,
        },
        2.0,
    ),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["tiny", "small"] if torch.cuda.is_available() else ["tiny"]
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=default)
    p.add_argument("--steps", type=int, default=300, help="decode steps per run (about)")
    p.add_argument("--warmup", type=int, default=30, help="decode steps left out of the stats")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting (alternating)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny ops: 1)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_once(name: str, debug: bool, steps: int, warmup: int) -> dict[str, Any]:
    """One engine run with PLANNER_DEBUG set or unset; step-time statistics after warm-up."""
    yaml_name, overrides, per_request = CONFIGS[name]
    # the synchronous loop: each step's time is its own (a loop ahead overlaps them)
    overrides = overrides | {"loop.requests": int(steps / per_request) + 4, "loop.overlap": False}
    old = os.environ.pop("PLANNER_DEBUG", None)
    if debug:
        os.environ["PLANNER_DEBUG"] = "1"
    try:
        engine = DecodeEngine(load_run_config(ROOT / "configs" / yaml_name, overrides))
    finally:
        os.environ.pop("PLANNER_DEBUG", None)
        if old is not None:
            os.environ["PLANNER_DEBUG"] = old
    assert engine.planner.debug is debug
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        result = engine.run(progress=False, max_steps=None)
    decode = result.step_seconds[warmup:]
    stats = engine.runner.stats
    graph_steps = max(1, stats.graph_steps)
    return {
        "config": name,
        "debug": debug,
        "device": str(engine.device),
        "graph_kind": stats.kind,
        "decode_steps": len(decode),
        "prefill_steps": result.prefill_steps,
        "step_ms_p50": 1e3 * statistics.median(decode),
        "step_ms_p90": 1e3 * _percentile(decode, 90),
        "step_ms_mean": 1e3 * statistics.fmean(decode),
        "prefill_ms_mean": 1e3 * result.prefill_seconds / result.prefill_steps
        if result.prefill_steps
        else 0.0,
        "verify_ms_per_replay": 1e3 * stats.host_seconds["verify"] / graph_steps,
        "verified": engine.planner.stats.verified,
        "wall_seconds": result.wall_seconds,
        "tokens": result.generated_tokens,
    }


def measure(name: str, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(repeats):
        for debug in (False, True):
            runs[debug].append(run_once(name, debug, steps, warmup))
    off = min(runs[False], key=lambda r: r["step_ms_mean"])
    on = min(runs[True], key=lambda r: r["step_ms_mean"])
    return {
        "config": name,
        "off": off,
        "on": on,
        "p50_ratio": on["step_ms_p50"] / off["step_ms_p50"],
        "mean_ratio": on["step_ms_mean"] / off["step_ms_mean"],
        "prefill_ratio": on["prefill_ms_mean"] / off["prefill_ms_mean"]
        if off["prefill_ms_mean"]
        else None,
    }


def render(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<7} {'device':<7} {'graphs':<9} {'steps':>6} "
        f"{'p50 off':>9} {'p50 on':>9} {'mean off':>9} {'mean on':>9} {'x mean':>7} "
        f"{'verify':>9} {'prefill off':>12} {'prefill on':>11}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        off, on = row["off"], row["on"]
        lines.append(
            f"{row['config']:<7} {off['device']:<7} {off['graph_kind']:<9} "
            f"{off['decode_steps']:>6} {off['step_ms_p50']:>7.2f}ms {on['step_ms_p50']:>7.2f}ms "
            f"{off['step_ms_mean']:>7.2f}ms {on['step_ms_mean']:>7.2f}ms "
            f"{row['mean_ratio']:>6.2f}x {on['verify_ms_per_replay']:>7.2f}ms "
            f"{off['prefill_ms_mean']:>10.2f}ms {on['prefill_ms_mean']:>9.2f}ms"
        )
    lines.append("verify = Planner.verify per replayed step (debug on); prefill = eager steps")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The rows (debug off and on per config) and the machine, printed and written."""
    args = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = [measure(name, args.steps, args.warmup, args.repeats) for name in args.configs]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = {
        "rows": rows,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": load,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },
    }
    print(render(rows))
    if load is not None:
        print(f"load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
