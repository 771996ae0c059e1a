"""The ``topk`` and ``sweep`` sections of benchmarks/bench_moe_topk.py: length-aware top-k.

``row_topk`` (Triton) against today's path (mask past each row's length, ``torch.topk``
over the full width): bit-equal to ``reference_row_topk`` and the same sets as
``torch.topk`` on distinct scores; the sweep times the kernel's block / warps choices.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from backends.common.triton_kernels import triton_available
from backends.nsa.topk import row_topk
from backends.nsa.topk_ref import reference_row_topk
from backends.nsa.topk_triton import row_topk_triton
from benchmarks.graph_timers import time_eager, time_graph

TOPK = 2048


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
