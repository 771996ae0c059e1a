#!/usr/bin/env python3
"""Where the planner's host time goes: a profile of replay, the runner's step and eager plans.

Why: the interleaved splits (``replay_pieces``, ``eager_pieces``) time the pieces the code
is made of; a profile shows the calls nobody named, and on CUDA the launches and hidden
synchronisations. Per phase: the functions that take the host time (cProfile, inclusive
and exclusive), and on CUDA a torch.profiler summary (CPU and CUDA activities). The
phases: ``replay()`` staged by the copy and by the graph's pull (``PulledTransport``; no
graph launched, so every replay refills one slot), the graph runner's step with each
(replay, inputs, the graph's launch), eager decode and extend plans, a FlashInfer replay.
Beside them the floors of what a replay must do (an empty pinned host-to-device copy, a
``data_ptr()`` loop over the plan tensors, a numpy range check of a staging buffer) and
FlashInfer's own ``plan()`` of the same batch. Prints a short table of medians per phase
and the top functions; ``--out`` writes everything as JSON.

    python3 -m benchmarks profile_host --out $OUT/profile_host.json
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import warnings

import numpy as np
import torch

from benchmarks.common import (
    cprofile_top,
    machine,
    num_sms_of,
    print_table,
    sync,
    time_host,
    write_json,
)
from benchmarks.host.planner_overhead import extend_setup
from graphs import GraphRunner, PulledTransport
from planner import Limits, Planner, PlanSet
from tests.support.batches import make_pool, random_batch

GPU_STEPS = {
    "": "--out {out}/profile_host.json",
}


def _torch_profile(fn, iters: int, device: torch.device) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(iters):
            fn(i)
        sync(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="host-time profile of the planner's phases")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    bs, ctx = args.batch, args.context
    table = make_pool(bs + 1, ctx, 64).to(device)
    sms = num_sms_of(device)
    limits = Limits(
        max_batch=bs,
        max_context=ctx,
        num_sms=sms,
        kv_slots=int(table.max()) + 1,
        device=str(device),
    )
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}}, debug=False)
    pulled = Planner(
        ["nsa"], limits, options={"nsa": {"topk": 2048}}, debug=False, transport=PulledTransport
    )
    rng = random.Random(0)
    batches = [
        random_batch(rng, table.cpu(), max_batch=bs, max_context=ctx, bs=bs, positions=True)
        for _ in range(8)
    ]
    batches = [dataclasses.replace(b, req_to_token=table) for b in batches]

    def forward(inputs, plans: PlanSet) -> torch.Tensor:
        return plans["nsa"].kv_lens.float()  # a read of the plan, no model: host cost only

    runner = GraphRunner(planner, forward, req_to_token=table, sizes=[bs])
    pulling = GraphRunner(pulled, forward, req_to_token=table, sizes=[bs])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.capture()
        pulling.capture()
    staged = torch.zeros(1024, dtype=torch.int32, pin_memory=device.type == "cuda")
    dev = torch.zeros(1024, dtype=torch.int32, device=device)
    plan_tensors = list(planner.replay(batches[0], bs)["nsa"].tensors().values())
    host = np.zeros(1024, dtype=np.int64)
    lo, hi = np.zeros_like(host), np.full_like(host, 1 << 30)
    extend_planner, extend_batch = extend_setup(ctx, device, 0)
    fi_planner = Planner(["flashinfer_decode"], limits, debug=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fi_planner.capture(bs, req_to_token=table)
    fi_plan = fi_planner.replay(batches[0], bs)["flashinfer_decode"]
    fi_slot = fi_plan.wrapper.slot
    phases = {
        "planner.replay (copy)": lambda i: planner.replay(batches[i % 8], bs),
        "planner.replay (pulled, no launch)": lambda i: pulled.replay(batches[i % 8], bs),
        "runner.step, copy (replay + inputs + graph)": lambda i: runner.step(batches[i % 8]),
        "runner.step, pulled (replay + inputs + graph)": lambda i: pulling.step(batches[i % 8]),
        "planner.plan (eager)": lambda i: planner.plan(batches[i % 8]),
        "planner.plan (eager extend, 2048 tokens)": lambda i: extend_planner.plan(extend_batch),
        "planner.replay (flashinfer_decode)": lambda i: fi_planner.replay(batches[i % 8], bs),
        "floor: pinned H2D copy_ (non_blocking)": lambda i: dev.copy_(staged, non_blocking=True),
        "floor: data_ptr() loop over the plan tensors": lambda i: [
            t.data_ptr() for t in plan_tensors
        ],
        "floor: numpy range check of a staging buffer": lambda i: bool(
            ((host < lo) | (host > hi)).any()
        ),
    }
    if getattr(fi_slot, "wrapper", None) is not None:  # FlashInfer itself, where it runs
        phases["floor: FlashInfer's own plan() of the same batch"] = lambda i: (
            fi_slot._plan_wrapper(fi_plan.kv_indices)
        )
    results = {}
    for name, fn in phases.items():
        for i in range(30):
            fn(i)
        sync(device)
        timed = time_host(fn, warmup=0, iters=args.iters)
        median, p99 = timed["median_us"], timed["p99_us"]
        sync(device)
        results[name] = {"median_us": median, "p99_us": p99}
        if not name.startswith("floor"):
            results[name]["top"] = cprofile_top(fn, args.iters, args.top)
            if device.type == "cuda":
                results[name]["torch_profile"] = _torch_profile(fn, 20, device)
        sync(device)
    table_text = print_table(
        f"host time per call, batch {bs}, context {ctx} ({device})",
        ("phase", "median us", "p99 us"),
        [(k, v["median_us"], v["p99_us"]) for k, v in results.items()],
    )
    for name, r in results.items():
        if "top" in r:
            print(f"\n{name}: top functions by self time (us per call)")
            for row in r["top"]:
                print(
                    f"  {row['self_us']:8.2f} self {row['total_us']:8.2f} total  {row['calls_per_iter']:5.1f}x  {row['function']}"
                )
            if "torch_profile" in r:
                print(r["torch_profile"])
    write_json(
        args.out,
        {"machine": machine(), "args": vars(args), "results": results, "table": table_text},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
