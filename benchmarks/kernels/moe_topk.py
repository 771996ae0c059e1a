#!/usr/bin/env python3
"""Check and time the routed MoE and the length-aware indexer top-k on one GPU.

Run on the CUDA machine (carry ``.whl``: the models need pydantic)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks moe_topk --out "$OUT" --plot "$OUT/bench_moe_topk.png"

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
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from backends.common.triton_kernels import triton_available
from backends.nsa.topk import row_topk
from backends.nsa.topk_ref import reference_row_topk
from backends.nsa.topk_triton import row_topk_triton
from benchmarks.common import machine, plot_bars, print_table, time_eager, time_graph, write_json
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.layers.ffn import DenseMoE, MoE
from dsv32_engine.models.layers.grouped_gemm import grouped_mm_provider

GPU_STEPS = {
    "": "--out {out} --iters 30",
}

TOPK = 2048


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


# ---------------------------------------------------------------------- moe
# The routed ``MoE`` (auto provider and the Triton grouped GEMM) shares the dense module's
# weights (a real-sized layer is 22 GB, so no copy), must match it within a relative 1e-2
# and replay under a CUDA graph as it runs eagerly; each variant's time comes with the
# expert weight bytes it must read.


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius relative error in float64, so bf16 rounding is measured, not repeated."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def make_moe(cfg: DSV32Config, device: torch.device, dtype: torch.dtype) -> MoE:
    """Random weights at sensible scales (activations O(1)), allocated on the device."""
    with torch.device(device):
        moe = MoE(cfg, dtype)
    d = cfg.hidden_size
    with torch.no_grad():
        moe.gate.weight.normal_(0, d**-0.5)
        moe.gate.bias.normal_(0, 0.05)
        ins, outs = [moe.w1, moe.w3], [moe.w2]  # fan-in dim, fan-in inter
        if moe.shared is not None:
            ins += [moe.shared.w1.weight, moe.shared.w3.weight]
            outs.append(moe.shared.w2.weight)
        for p in ins:
            p.normal_(0, d**-0.5)
        for p in outs:
            p.normal_(0, p.shape[-1] ** -0.5)
    return moe


def expert_bytes(cfg: DSV32Config, experts: int, dtype: torch.dtype) -> int:
    per = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.finfo(dtype).bits // 8
    return experts * per


def _share(cls: type[MoE], cfg: DSV32Config, moe: MoE, **kw: Any) -> MoE:
    """A ``cls`` module over ``moe``'s tensors (no copy: a real layer is 22 GB)."""
    with torch.device("meta"):
        twin = cls(cfg, moe.w1.dtype, **kw)
    twin.load_state_dict(moe.state_dict(), assign=True)
    return twin


def moe_case(
    args: argparse.Namespace, name: str, cfg: DSV32Config, variants: dict[str, MoE], x: torch.Tensor
) -> tuple[dict[str, Any], list[str]]:
    """One (shape, rows) cell: errors against dense, replay check, times, bytes."""
    fails, rows = [], x.shape[0]
    timer = time_eager if x.device.type == "cpu" else time_graph
    pairs = torch.empty(rows * cfg.num_experts_per_tok, cfg.hidden_size, dtype=x.dtype)
    provider = grouped_mm_provider(pairs.to(x.device), variants["routed"].w1.transpose(1, 2))
    row: dict[str, Any] = {"shape": name, "rows": rows, "provider": provider}
    with torch.no_grad():
        want = variants["dense"](x)
        row["experts_used"] = chosen = variants["routed"].gate(x)[1].unique().numel()
        for label, module in variants.items():
            try:
                if label != "dense":
                    row[f"{label}_err"] = err = rel_err(module(x), want)
                    if not err < 1e-2:
                        fails.append(f"moe {name} rows={rows} {label}: rel err {err:.3g}")
                    if x.device.type == "cuda" and not replay_matches_eager(module, x):
                        fails.append(f"moe {name} rows={rows} {label}: replay differs from eager")
                t = timer(lambda m=module: m(x), warmup=args.warmup, iters=args.iters)
            except Exception as e:  # record and go on: one broken variant spoils no other
                fails.append(f"moe {name} rows={rows} {label}: {type(e).__name__}: {e}")
                row[f"{label}_error"] = traceback.format_exc(limit=3)
                continue
            gb = expert_bytes(cfg, cfg.n_routed_experts if label == "dense" else chosen, x.dtype)
            row[label] = {
                **t,
                "weights_GB": gb / 1e9,
                "TB_per_s": gb / 1e12 / (t["median_us"] * 1e-6),
            }
    return row, fails


def moe_section(args: argparse.Namespace, device: torch.device, fails: list[str]) -> list[dict]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    names = ["tiny"] if args.smoke else args.moe_shapes
    results = []
    for name in names:
        cfg = DSV32Config.preset(name)
        moe = make_moe(cfg, device, dtype)
        variants = {"dense": _share(DenseMoE, cfg, moe), "routed": moe}
        if device.type == "cuda":
            variants["routed_triton"] = _share(MoE, cfg, moe, grouped_mm_provider="triton")
        gen = torch.Generator(device=device).manual_seed(args.seed)
        for rows in args.rows:
            x = torch.randn(rows, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
            row, bad = moe_case(args, name, cfg, variants, x)
            results.append(row)
            fails += bad
        del moe, variants
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def replay_matches_eager(module: MoE, x: torch.Tensor) -> bool:
    """Capture on one input, replay on another: the replay must be that input's eager result."""
    static = x.clone()
    module(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(static)
    static.copy_(torch.randn_like(x))
    graph.replay()
    return torch.equal(y, module(static))


# ---------------------------------------------------------------------- topk and sweep
# ``row_topk`` (Triton) against today's path (mask past each row's length, ``torch.topk``
# over the full width): bit-equal to ``reference_row_topk`` and the same sets as
# ``torch.topk`` on distinct scores; the sweep times the kernel's block / warps choices.


def lengths_of(kind: str, rows: int, width: int, gen: torch.Generator, device) -> torch.Tensor:
    """Row lengths: random, all 300 (short prompts: most of the width masked) or all full."""
    if kind == "random":
        return torch.randint(1, width + 1, (rows,), generator=gen, device=device, dtype=torch.int32)
    n = 300 if kind == "short300" else width
    return torch.full((rows,), min(n, width), dtype=torch.int32, device=device)


def topk_by_torch(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Today's ``indexer_topk`` selection: mask past the length, ``torch.topk`` over the width."""
    width = logits.shape[1]
    pos = torch.arange(width, device=logits.device)
    masked = logits.masked_fill(pos >= lengths.long().unsqueeze(1), float("-inf"))
    return torch.topk(masked, min(k, width), dim=-1).indices


def as_ascending(idx: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk`` indices in the row_topk layout: valid ones ascending, then -1."""
    big = torch.iinfo(torch.int32).max
    valid = idx < lengths.long().unsqueeze(1)
    packed = torch.where(valid, idx, big).sort(1).values
    packed = torch.where(packed == big, -1, packed).to(torch.int32)
    return torch.nn.functional.pad(packed, (0, k - packed.shape[1]), value=-1)


def topk_k(args: argparse.Namespace) -> int:
    return 16 if args.smoke else TOPK


def topk_section(args: argparse.Namespace, device: torch.device, fails: list[str]) -> list[dict]:
    k = topk_k(args)
    widths = [256] if args.smoke else args.widths
    rows_list = [1, 4] if args.smoke else args.rows
    timer = time_eager if device.type == "cpu" else time_graph
    can_triton = triton_available(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    results = []
    for width in widths:
        for rows in rows_list:
            for kind in ("random", "short300", "full"):
                lengths = lengths_of(kind, rows, width, gen, device)
                base = torch.randn(rows, width + 64, device=device, generator=gen)
                logits = base[:, :width]  # strided like deep_gemm's output
                distinct = torch.randperm(rows * width, device=device, generator=gen)
                distinct = distinct.float().view(rows, width)
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                row: dict[str, Any] = {"width": width, "rows": rows, "lengths": kind}
                if can_triton:
                    got = row_topk_triton(logits, lengths, k, out).clone()
                    if not torch.equal(got, reference_row_topk(logits, lengths, k)):
                        fails.append(f"topk {width}/{rows}/{kind}: differs from the reference")
                    got = row_topk_triton(distinct, lengths, k, out).clone()
                    if not torch.equal(
                        got, as_ascending(topk_by_torch(distinct, lengths, k), lengths, k)
                    ):
                        fails.append(f"topk {width}/{rows}/{kind}: sets differ from torch.topk")
                row["torch_topk"] = timer(
                    lambda x=logits, n=lengths: topk_by_torch(x, n, k),
                    warmup=args.warmup,
                    iters=args.iters,
                )
                if device.type == "cuda":
                    row["triton"] = timer(
                        lambda x=logits, n=lengths, o=out: row_topk(x, n, k, o),
                        warmup=args.warmup,
                        iters=args.iters,
                    )
                results.append(row)
    return results


def sweep_section(args: argparse.Namespace, device: torch.device, fails: list[str]) -> list[dict]:
    if device.type != "cuda" or args.smoke:
        return []
    rows, width = 128, max(args.widths)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    logits = torch.randn(rows, width, device=device, generator=gen)
    lengths = torch.full((rows,), width, dtype=torch.int32, device=device)
    want = reference_row_topk(logits, lengths, TOPK)
    out = torch.empty_like(want)
    results = []
    for block in (512, 1024, 2048):
        for warps in (4, 8, 16):
            row_topk_triton(logits, lengths, TOPK, out, block=block, num_warps=warps)
            if not torch.equal(out, want):
                fails.append(f"sweep block={block} warps={warps}: differs from the reference")
            t = time_graph(
                lambda b=block, w=warps: row_topk_triton(
                    logits, lengths, TOPK, out, block=b, num_warps=w
                ),
                warmup=args.warmup,
                iters=args.iters,
            )
            results.append({"block": block, "warps": warps, **t})
    return results


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


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The sections' results (``failures`` lists every failed check)."""
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


def main(argv: Sequence[str] | None = None) -> int:
    return 1 if run(argv)["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
