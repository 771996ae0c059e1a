#!/usr/bin/env python3
"""Check and time the routed MoE and the length-aware indexer top-k on one GPU.

Run on the CUDA machine (carry ``.whl``: the models need pydantic)::

    source scripts/device_prelude.sh || exit 1
    python3 benchmarks/bench_moe_topk.py --out "$OUT" --plot "$OUT/bench_moe_topk.png"

Sections, random data from a fixed seed, every variant timed as CUDA-graph replays
(warm-up, capture, replay; median and p99 of CUDA-event times per replay):

* ``moe``: routed ``MoE`` (auto provider, normally ``torch._grouped_mm``, and the
  Triton grouped GEMM) against ``DenseMoE`` (every expert on every row) at the
  dsv32-small MoE shape and a real-sized layer (7168 / 256 experts / top-8 / 2048),
  bf16, rows 1/16/64/128. Checks: relative error < 1e-2 against dense, replay equal
  to eager. Also the weight bytes each variant must read and the rate achieved.
* ``topk``: ``row_topk`` (Triton) against the current path (mask past the length,
  ``torch.topk`` over the full width), k 2048, widths 4096 / 16384, rows 1..128,
  lengths random / all 300 / all full. Checks: bit-equal to ``reference_row_topk``
  and the same sets as ``torch.topk`` on distinct scores.
* ``sweep``: Triton top-k block / warps at width 16384, 128 full rows.

Prints tables of medians and ratios, writes ``bench_moe_topk.json`` under ``--out``,
exits 1 on any failed check. ``--smoke`` runs tiny sizes eagerly on the CPU (what the
test suite does so the script cannot rot); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, plot_bars, print_table, write_json  # noqa: E402
from benchmarks.routed_moe_section import moe_section  # noqa: E402
from benchmarks.row_topk_section import sweep_section, topk_k, topk_section  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for bench_moe_topk.json")
    p.add_argument("--plot", help="PNG of speedups over the baseline of each case")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, eager, CPU is fine")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--moe-shapes", nargs="+", default=["small", "full"])
    p.add_argument("--widths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- report


def _med(row: dict, key: str) -> float | str:
    return row[key]["median_us"] if key in row else "-"


def _ratio(row: dict, num: str, den: str) -> float | str:
    return row[num]["median_us"] / row[den]["median_us"] if num in row and den in row else "-"


def render(result: dict[str, Any]) -> dict[str, float]:
    """Print the tables; return each case's speedup over its baseline (for the plot)."""
    moe = [
        [r["shape"], r["rows"], r["provider"], r.get("experts_used", "-"), _med(r, "dense"),
         _med(r, "routed"), _med(r, "routed_triton"), _ratio(r, "dense", "routed"),
         _ratio(r, "dense", "routed_triton"), r.get("routed", {}).get("TB_per_s", "-"),
         r.get("routed_err", "-")]
        for r in result["moe"]
    ]  # fmt: skip
    print_table(
        "MoE (median us per forward; x = dense / routed)",
        ["shape", "rows", "provider", "experts", "dense", "routed", "triton", "x", "x_tri", "TB/s",
         "err"],
        moe,
    )  # fmt: skip
    topk = [
        [r["width"], r["rows"], r["lengths"], _med(r, "torch_topk"), _med(r, "triton"),
         _ratio(r, "torch_topk", "triton")]
        for r in result["topk"]
    ]  # fmt: skip
    print_table(
        f"top-{result['topk_k']} (median us; x = torch.topk / triton)",
        ["width", "rows", "lengths", "torch.topk", "triton", "x"],
        topk,
    )
    if result["sweep"]:
        print_table(
            "Triton top-k, widest width, 128 full rows",
            ["block", "warps", "median_us", "p99_us"],
            [[r["block"], r["warps"], r["median_us"], r["p99_us"]] for r in result["sweep"]],
        )
    print("\n  ".join(["FAILURES:", *result["failures"]]) if result["failures"] else "all passed")
    speedups = {f"moe {r[0]} r{r[1]}": r[7] for r in moe}
    speedups.update({f"topk {r[0]} r{r[1]} {r[2]}": r[5] for r in topk})
    return {name: x for name, x in speedups.items() if isinstance(x, float)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.iters, args.warmup, args.rows = min(args.iters, 3), 1, [1, 4]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA: run with --smoke for a CPU check", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(args.seed)
    fails: list[str] = []
    result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    result["moe"] = moe_section(args, device, fails)
    result["topk"] = topk_section(args, device, fails)
    result["topk_k"] = topk_k(args)
    result["sweep"] = sweep_section(args, device, fails)
    result["failures"] = fails
    speedups = render(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(str(Path(args.out) / "bench_moe_topk.json"), result)
    plot_bars(
        args.plot, "speedup over baseline", list(speedups), {"x": list(speedups.values())}, "x"
    )
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
