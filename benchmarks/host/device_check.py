#!/usr/bin/env python3
"""GPU time of the device check of a step's inputs, beside the planner's record and a launch.

Each captured decode bucket's graph replays, on a CUDA graph of its own:
- ``check``: the device check alone (``planner.device_checks``: ranges, repeats, positions,
  token-table entries, pads, error word) over a valid batch;
- ``record``: everything the planner records before the layers (the pull or nothing, the
  check, every in-graph op);
- ``floor``: a graph of one one-element kernel (what any graph step costs at least).
Median and p99 over ``--iters`` replays timed with CUDA events, after warm-up; the columns
are what each replay adds to a step's GPU time.

    python3 -m benchmarks device_check --out "$OUT/device_check.json"

``--device cpu`` runs the same calls without graphs (a smoke test; the numbers then are the
torch ops' host cost on the CPU).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import backends  # noqa: F401  (registers the backends)
from benchmarks.common import machine, num_sms_of, print_table, write_json
from planner import ForwardBatch, ForwardMode, Limits, Planner

GPU_STEPS = {
    "": "--out {out}/device_check.json",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--max-context", type=int, default=4352, help="dsv32-small's")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def _batch(table: torch.Tensor, bs: int, rng: random.Random) -> ForwardBatch:
    ctx = table.shape[1]
    lens = [rng.randint(1, ctx) for _ in range(bs)]
    pools = rng.sample(range(1, table.shape[0]), bs)
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(pools, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor(
            [int(table[p, n - 1]) for p, n in zip(pools, lens)], dtype=torch.int32
        ),
    )


def _timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> dict:
    """Median and p99 microseconds of ``fn`` (a graph replay): CUDA events on a GPU, the
    host clock on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
    samples.sort()
    return {"median_us": statistics.median(samples), "p99_us": samples[int(0.99 * len(samples))]}


def _graphed(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (its replay), or ``fn`` itself off CUDA."""
    if device.type != "cuda":
        return fn
    fn()  # outside the capture first: lazy state, JIT
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    top = max(args.batches)
    pages = -(-args.max_context // 64)
    slots = (top + 1) * pages * 64
    table = torch.arange(slots, dtype=torch.int32, device=device).view(top + 1, pages * 64)
    table = table[:, : args.max_context].contiguous()
    limits = Limits(
        max_batch=top,
        max_context=args.max_context,
        page_size=64,
        num_sms=num_sms_of(device),
        device=str(device),
        kv_slots=slots,
    )
    planner = Planner(["nsa", "paged"], limits)
    rng = random.Random(0)
    rows, results = [], []
    one = torch.zeros(1, device=device)
    floor = _timed(_graphed(lambda: one.add_(1), device), device, args.warmup, args.iters)
    for bs in args.batches:
        planner.capture(bs, req_to_token=table)
        planner.replay(_batch(table.cpu() if device.type == "cpu" else table, bs, rng), bs)
        captured = planner._captured[(ForwardMode.DECODE, bs)]  # a benchmark may look inside
        step = captured.steps[0]

        def check_only(step=step, captured=captured) -> None:
            step.check_inputs(captured.check, captured.error)

        check = _timed(_graphed(check_only, device), device, args.warmup, args.iters)
        record = _timed(
            _graphed(lambda bs=bs: planner.record(bs), device), device, args.warmup, args.iters
        )
        planner.read_errors()  # the replays above checked a valid batch
        results.append({"bs": bs, "check": check, "record": record, "floor": floor})
        rows.append(
            [
                bs,
                f"{check['median_us']:.1f} ({check['p99_us']:.1f})",
                f"{record['median_us']:.1f} ({record['p99_us']:.1f})",
                f"{floor['median_us']:.1f}",
            ]
        )
    print_table(
        f"device check, GPU time per replay, median (p99) us, max_context {args.max_context}",
        ["bs", "check", "planner record", "floor"],
        rows,
    )
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
