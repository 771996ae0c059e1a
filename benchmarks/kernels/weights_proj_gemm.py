#!/usr/bin/env python3
"""The indexer's fp32 head-weight projection, three ways, inside CUDA graphs.

``weights_proj`` is ``[64, 7168]`` fp32 in the reference model. Per decode step and layer
the model computed ``linear(x.float()) * scale``: a cast, cuBLAS's fp32 GEMM (SIMT plus a
split-K reduction at these sizes) and a multiply. Compared here, each as 61 calls captured
in one graph (a decode step's layers; graph launch cost amortised), per-call device time:

- ``fp32``: that path;
- ``bf16_terms``: ``models.layers.bf16_terms`` (one bf16 GEMM over the weight's three bf16
  terms with fp32 output, a 3-way sum) and the multiply;
- ``bf16_weight``: the weight rounded to bf16 once, a plain bf16 GEMM, for scale only
  (not a candidate: it changes the model's numerics).

Also the max error of each against float64. Medians and p99 over ``--iters`` replays.

    python3 -m benchmarks weights_proj_gemm --out $OUT/weights_proj.json --plot $OUT/wp.png
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from benchmarks.common import machine, plot_bars, print_table, time_graph, write_json
from dsv32_engine.models.layers.bf16_terms import Bf16TermsProjection, mm_fp32_out_available

GPU_STEPS = {
    "": "--out {out}/weights_proj_gemm.json --plot {out}/weights_proj_gemm.png",
}

LAYERS = 61
SCALE = 64**-0.5 * 128**-0.5


def measure(rows: int, iters: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(7168, 64, bias=False).to(dev).requires_grad_(False)
    linear.weight.copy_((torch.randn(64, 7168, generator=gen) * 0.02).to(dev))
    x = torch.randn(rows, 7168, generator=gen).to(device=dev, dtype=torch.bfloat16)
    exact = (x.double() @ linear.weight.double().t()) * SCALE
    terms = Bf16TermsProjection(linear)
    w_bf16 = linear.weight.to(torch.bfloat16)
    ways = {
        "fp32": lambda: linear(x.float()) * SCALE,
        "bf16_terms": lambda: terms(x) * SCALE,
        "bf16_weight": lambda: torch.mm(x, w_bf16.t(), out_dtype=torch.float32) * SCALE,
    }
    out: dict[str, Any] = {"rows": rows}
    for name, fn in ways.items():
        out[name] = time_graph(fn, warmup=10, iters=iters, reps=LAYERS)
        out[f"{name}_max_abs_err"] = (fn().double() - exact).abs().max().item()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="indexer fp32 head-weight projection, three ways")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--iters", type=int, default=200, help="graph replays per variant")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG of the medians")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: this compares GPU kernels")
        return 2
    if not mm_fp32_out_available(torch.device("cuda")):
        print("this torch has no bf16 -> fp32 torch.mm (out_dtype); nothing to compare")
        return 2
    results = [measure(r, args.iters) for r in args.rows]
    names = ("fp32", "bf16_terms", "bf16_weight")
    rows = [
        [r["rows"]]
        + [f"{r[n]['median_us']:.2f} ({r[n]['p99_us']:.2f})" for n in names]
        + [f"{r['bf16_terms']['median_us'] / r['fp32']['median_us']:.2f}"]
        + [f"{r[n + '_max_abs_err']:.2e}" for n in names]
        for r in results
    ]
    header = ["rows", *(f"{n} us p50 (p99)" for n in names), "terms/fp32"]
    header += [f"{n} err" for n in names]
    print_table("per-call device us, 61 calls a graph", header, rows)
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    plot_bars(
        args.plot,
        "indexer weights_proj per call",
        [f"rows {r['rows']}" for r in results],
        {n: [r[n]["median_us"] for r in results] for n in names},
        "device us per call (median)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
