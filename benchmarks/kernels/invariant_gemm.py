"""The batch-invariant GEMM against cuBLAS on DeepSeek-V3.2's GEMM sites, beside the HBM floor.

Issue 39's speed claim is the invariant mode's decode step at most 1.35x the default's; a
decode GEMM reads its weight once, so each site is timed at a few row counts for: cuBLAS
(``F.linear`` or the batched per-head product, what the default mode runs), the invariant
kernel with its tile configuration (``tile_config``: split along K where a weight has few
column tiles), the same kernel unsplit, and ``--sweep``'s configurations. The floor is the
weight's bytes over a device-to-device copy's bandwidth measured in the same process. Every
variant runs 20 calls inside one CUDA graph (a decode step replays them so; a Python launch
would time the host), timed with events (``benchmarks.common.time_graph``): median of ``--iters``
replays per call. The invariant kernel's rows are also checked bit for bit: row 0 alone
equals row 0 in the batch.

    python3 -m benchmarks invariant_gemm --out "$OUT/invariant_gemm.json"   # a GPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import machine, plot_bars, print_table, time_graph, write_json
from dsv32_engine.models.layers.invariant_gemm import (
    TileConfig,
    invariant_mm,
    narrow_block_n,
    tile_config,
)

GPU_STEPS = {
    "": "--out {out}/invariant_gemm.json",
}

SITES: dict[str, tuple[int, int, int, torch.dtype]] = {
    # name: (N, K, groups, weight dtype), DeepSeek-V3.2's dimensions
    "wq_a|wkv_a|wk": (2240, 7168, 1, torch.bfloat16),
    "wq_b": (24576, 1536, 1, torch.bfloat16),
    "indexer wq_b": (8192, 1536, 1, torch.bfloat16),
    "absorb (128 heads)": (512, 128, 128, torch.bfloat16),
    "mla out (128 heads)": (128, 512, 128, torch.bfloat16),
    "wo": (7168, 16384, 1, torch.bfloat16),
    "shared gate_up": (4096, 7168, 1, torch.bfloat16),
    "shared down": (7168, 2048, 1, torch.bfloat16),
    "moe gate": (256, 7168, 1, torch.bfloat16),
    "weights_proj (fp32)": (64, 7168, 1, torch.float32),
    "dense gate_up": (36864, 7168, 1, torch.bfloat16),
    "dense down": (7168, 18432, 1, torch.bfloat16),
    "lm head": (129280, 7168, 1, torch.bfloat16),
}
CALLS = 20


def _unsplit(config: TileConfig, n: int, groups: int) -> TileConfig:
    """The kernel before K splits: ``BLOCK_N`` narrowed for column tiles instead."""
    return TileConfig(config[0], narrow_block_n(n, groups), *config[2:5], 1)


def _call(a: torch.Tensor, w: torch.Tensor, config: TileConfig | None, out_dtype: torch.dtype):
    """One variant's GEMM of ``a [G, M, K]`` by ``w [G, N, K]``: cuBLAS where ``config`` is
    None (what the default mode runs), else the invariant kernel in that configuration."""
    b = w.transpose(1, 2)
    if config is not None:
        return lambda: invariant_mm(a, b, out_dtype=out_dtype, config=config)
    if w.shape[0] == 1:
        return lambda: F.linear(a[0].to(w.dtype), w[0])
    return lambda: torch.bmm(a, b)


def _graph_time(fn, iters: int) -> float:
    """Microseconds per call: ``CALLS`` calls in one graph, median over ``iters`` replays."""
    return time_graph(fn, warmup=3, iters=iters, reps=CALLS)["median_us"]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted once each)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    us = _graph_time(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 2 / (us * 1e-6)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    bandwidth = copy_bandwidth(device)
    rows = []
    for name, (n, k, groups, wdtype) in SITES.items():
        if args.sites and name not in args.sites:
            continue
        w = (torch.randn(groups, n, k, generator=gen, device=device) / k**0.5).to(wdtype)
        b = w.transpose(1, 2)  # [G, K, N], an nn.Linear weight's view
        ieee = wdtype == torch.float32
        chosen = tile_config(n, k, groups, ieee)
        variants: dict[str, TileConfig | None] = {"cublas": None, "invariant": chosen}
        variants["unsplit"] = _unsplit(chosen, n, groups)
        for bn, splits in args.sweep:
            variants[f"bn{bn} s{splits}"] = TileConfig(chosen[0], bn, *chosen[2:5], splits)
        floor_us = w.numel() * w.element_size() / bandwidth * 1e6
        for m in args.rows:
            a = torch.randn(groups, m, k, generator=gen, device=device).to(torch.bfloat16)
            out_dtype = torch.float32 if ieee else torch.bfloat16
            times: dict[str, float] = {}
            for variant, config in variants.items():
                fn = _call(a, w, config, out_dtype)
                times[variant] = _graph_time(fn, args.iters)
            alone = invariant_mm(a[:, :1], b, out_dtype=out_dtype)
            batched = invariant_mm(a, b, out_dtype=out_dtype)
            rows.append({
                "site": name, "n": n, "k": k, "groups": groups, "m": m,
                "config": list(chosen), "floor_us": floor_us, "us": times,
                "row_invariant": bool(torch.equal(alone[:, 0], batched[:, 0])),
            })  # fmt: skip
    return {"machine": machine(), "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows}


def sums(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Microseconds per variant summed over the sites, per row count: a step's GEMMs."""
    out: dict[int, dict[str, float]] = {}
    for r in result["rows"]:
        for variant, us in r["us"].items():
            out.setdefault(r["m"], {}).setdefault(variant, 0.0)
            out[r["m"]][variant] += us
    return out


def table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    names = list(rows[0]["us"]) if rows else []
    print_table(
        f"GEMM sites, us per call (HBM floor at {result['copy_bandwidth_gbs']:.0f} GB/s copy)",
        ("site", "M", "splits", "floor", *names, "inv/cublas", "rows same"),
        [
            (r["site"], r["m"], r["config"][5], r["floor_us"], *(r["us"][v] for v in names),
             r["us"]["invariant"] / r["us"]["cublas"], "yes" if r["row_invariant"] else "NO")
            for r in rows
        ],
    )  # fmt: skip
    for m, total in sums(result).items():
        print(f"M {m}: sum over sites " + ", ".join(f"{v} {t:.1f} us" for v, t in total.items()))


def _pair(text: str) -> tuple[int, int]:
    bn, splits = text.split(":")
    return int(bn), int(splits)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512], help="M values")
    p.add_argument("--sites", nargs="*", help="only these sites (names as in SITES)")
    p.add_argument(
        "--sweep", type=_pair, nargs="*", default=[], metavar="BN:SPLITS",
        help="extra tile configurations to time beside the chosen one",
    )  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="graph replays per variant")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--plot", help="write a PNG here: each variant summed over the sites, per M")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("invariant_gemm times CUDA kernels: no CUDA device here")
    result = measure(args)
    table(result)
    write_json(args.out, result)
    totals = sums(result)
    variants = list(next(iter(totals.values()))) if totals else []
    plot_bars(
        args.plot,
        "DeepSeek-V3.2 GEMM sites: invariant kernel vs cuBLAS",
        [f"M {m}" for m in totals],
        {v: [totals[m][v] for m in totals] for v in variants},
        "us per step's GEMMs (sum over sites)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
