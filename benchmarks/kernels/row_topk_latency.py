#!/usr/bin/env python3
"""Latency of the indexer's row top-k kernels, variant by variant, as CUDA-graph replays.

Run on the CUDA machine (carry ``.whl``: the backends import pydantic)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks row_topk_latency --out "$OUT/row_topk_latency.json"

Decode calls the top-k once a layer inside a captured graph, at a few to a hundred rows:
what matters is how long one launch takes, not its throughput. Each configuration (the
chunked kernel as it ships, the resident kernel at several warp counts, resident blocks
and digit widths) is captured once per case and replayed; CUDA events around each replay
give the median and p99 in microseconds. Cases: rows x widths, k 2048, lengths random in
``[k + 1, width]`` (every row scored: the decode case once contexts pass k) and all full.
Every configuration's output is checked bit for bit against ``reference_row_topk`` (and,
with ``--mapped``, against ``map_positions_to_slots`` of it) on each case's inputs.

``--smoke --device cpu`` runs tiny sizes eagerly under the Triton interpreter, so a test can
keep the script from rotting; its numbers mean nothing. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

GPU_STEPS = {
    "": "--out {out}/row_topk_latency.json",
}

if "--smoke" in sys.argv and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402

from backends.common.triton_kernels import triton_available  # noqa: E402
from backends.nsa.topk_ref import map_positions_to_slots, reference_row_topk  # noqa: E402
from backends.nsa.topk_triton import default_resident, row_topk_triton  # noqa: E402
from benchmarks.common import machine, print_table, time_eager, time_graph, write_json  # noqa: E402

Config = tuple[str, dict[str, Any]]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes, few iterations, eager (CPU is fine)"
    )
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128], help="rows per case")
    p.add_argument("--widths", type=int, nargs="+", default=[4096, 16384], help="logits widths")
    p.add_argument("--k", type=int, default=2048, help="positions kept per row")
    p.add_argument("--warps", type=int, nargs="+", default=[8, 16], help="resident warps")
    p.add_argument(
        "--digits", type=int, nargs="+", default=[5, 8], help="resident bits per radix pass"
    )
    p.add_argument("--iters", type=int, default=300, help="timed replays per configuration")
    p.add_argument("--warmup", type=int, default=30, help="untimed replays first")
    p.add_argument("--seed", type=int, default=0, help="seed of the scores and lengths")
    p.add_argument(
        "--mapped", action="store_true", help="also time the fused slot mapping (next_n 1)"
    )
    p.add_argument(
        "--chain", type=int, default=20, help="launches per graph for the in-graph column"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.widths, args.k = [1, 4], [256], 16
        args.warps, args.digits, args.iters, args.warmup = [4], [5, 8], 2, 1
    return args


def configs(width: int, args: argparse.Namespace) -> list[Config]:
    """What to compare at one width: the chunked kernel as shipped first (the baseline),
    then the resident kernel at its default block for each digit width and warp count,
    and one other block."""
    out: list[Config] = [("chunked", {"variant": "chunked"})]
    res = default_resident(width)
    for bits in args.digits:
        for w in args.warps:
            knobs = {"variant": "resident", "num_warps": w, "digit_bits": bits}
            out.append((f"resident{res}-d{bits}-w{w}", knobs))
    # One other block: 8192 at narrow widths (the widest default: one compiled variant
    # would serve every width up to it), the whole row at 16384 (no re-read chunks); in
    # smoke runs 64, so rows longer than it take the re-read chunks.
    other = 64 if args.smoke else (8192 if width <= 8192 else 16384)
    if other != res:
        knobs = {"variant": "resident", "resident": other, "num_warps": args.warps[0],
                 "digit_bits": args.digits[0]}  # fmt: skip
        out.append((f"resident{other}-d{args.digits[0]}-w{args.warps[0]}", knobs))
    return out


def time_replays(fn: Callable[[], Any], *, reps: int, warmup: int, iters: int) -> dict[str, float]:
    """``fn`` captured ``reps`` times in one CUDA graph (``benchmarks.common.time_graph``)."""
    return time_graph(fn, warmup=warmup, iters=iters, reps=reps)


def lengths_of(kind: str, rows: int, width: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random lengths in ``[k + 1, width]`` (every row scored), or every row full."""
    if kind == "full" or width <= k + 1:
        return torch.full((rows,), width, dtype=torch.int32)
    return torch.randint(k + 1, width + 1, (rows,), generator=gen, dtype=torch.int32)


def run_case(
    args: argparse.Namespace,
    device: torch.device,
    width: int,
    rows: int,
    kind: str,
    gen: torch.Generator,
) -> list[dict[str, Any]]:
    k = args.k
    # Scores in a strided view, as deep_gemm's logits are (row stride past the width).
    logits = torch.randn(rows, width + 64, generator=gen)[:, :width].to(device)
    lengths = lengths_of(kind, rows, width, k, gen).to(device)
    slots = torch.randint(0, 2**31 - 1, (rows, width), generator=gen, dtype=torch.int32)
    slots = slots.to(device)
    want = reference_row_topk(logits, lengths, k)
    want_mapped = map_positions_to_slots(want, slots, 1) if args.mapped else None
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    results = []
    for mapped in (False, True) if args.mapped else (False,):
        table, expected = (slots, want_mapped) if mapped else (None, want)
        for name, knobs in configs(width, args):
            out.fill_(12345)  # poison: every entry must be written

            def launch(kw: dict[str, Any] = knobs, t: torch.Tensor | None = table) -> None:
                row_topk_triton(logits, lengths, k, out, slots=t, **kw)

            launch()
            ok = bool(torch.equal(out, expected))
            if device.type == "cuda":
                stats = time_replays(launch, reps=1, warmup=args.warmup, iters=args.iters)
                chain = time_replays(launch, reps=args.chain, warmup=2, iters=args.iters // 4)
                stats["chain_median_us"] = chain["median_us"]
            else:
                stats = time_eager(launch, warmup=args.warmup, iters=args.iters)
            results.append(
                {
                    "width": width,
                    "rows": rows,
                    "lengths": kind,
                    "mapped": mapped,
                    "config": name,
                    "knobs": knobs,
                    "ok": ok,
                    **stats,
                }
            )
    return results


def render(results: list[dict[str, Any]]) -> None:
    """One line per configuration and case, with its speedup over the chunked baseline."""
    base = {
        (r["width"], r["rows"], r["lengths"], r["mapped"]): r["median_us"]
        for r in results
        if r["config"] == "chunked"
    }
    chain = {
        (r["width"], r["rows"], r["lengths"], r["mapped"]): r.get("chain_median_us")
        for r in results
        if r["config"] == "chunked"
    }
    table = []
    for r in results:
        case = (r["width"], r["rows"], r["lengths"], r["mapped"])
        ref, cref = base.get(case), chain.get(case)
        table.append(
            [r["width"], r["rows"], r["lengths"], "slots" if r["mapped"] else "pos", r["config"],
             r["median_us"], r["p99_us"], ref / r["median_us"] if ref else "-",
             r.get("chain_median_us", "-"), cref / r["chain_median_us"] if cref else "-",
             "ok" if r["ok"] else "MISMATCH"]
        )  # fmt: skip
    print_table(
        "row top-k latency (us per launch, one launch a replay; in_graph: a chain of "
        "launches a replay; x = chunked / this)",
        [
            "width",
            "rows",
            "lengths",
            "out",
            "config",
            "median",
            "p99",
            "x",
            "in_graph",
            "x_in",
            "check",
        ],
        table,
    )


def best_per_case(results: list[dict[str, Any]]) -> dict[str, str]:
    """The fastest configuration of each case (in a chain where timed so: the in-model
    cost): what the defaults should follow."""
    best: dict[str, tuple[float, str]] = {}
    for r in results:
        case = f"{r['width']}/{r['rows']}/{r['lengths']}/{'slots' if r['mapped'] else 'pos'}"
        us = r.get("chain_median_us", r["median_us"])
        if r["ok"] and (case not in best or us < best[case][0]):
            best[case] = (us, r["config"])
    return {case: name for case, (_, name) in best.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not args.smoke:
        print("no CUDA: run with --smoke --device cpu for a CPU check")
        return 2
    if not triton_available(device):
        print(f"Triton cannot run on {device} (on the CPU it needs TRITON_INTERPRET=1)")
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    results: list[dict[str, Any]] = []
    for width in args.widths:
        for rows in args.rows:
            for kind in ("random", "full"):
                results += run_case(args, device, width, rows, kind, gen)
    render(results)
    mismatches = [f"{r['width']}/{r['rows']}/{r['lengths']}/{r['config']}" for r in results
                  if not r["ok"]]  # fmt: skip
    print("all outputs equal the reference" if not mismatches else f"MISMATCH: {mismatches}")
    write_json(
        args.out,
        {"machine": machine(), "args": vars(args), "results": results,
         "best": best_per_case(results), "mismatches": mismatches},
    )  # fmt: skip
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
