#!/usr/bin/env python3
"""An eager ``plan()`` taken apart: each piece timed on its own, beside the floors of the
CUDA calls it makes and the hand-written eager path.

Why: the eager plan misses its line (<= 100 us at bs 256, <= 0.8x hand-written) while its
cProfile breakdown spreads the time over many small Python calls, which the profiler
inflates 2-3x on the GPU host. Here every piece is called alone, interleaved call by call
with the whole plan, its floors and the hand-written code (``time_paired``: the host's
drift falls on all alike), so the table shows which pieces are worth a change.

The pieces (nsa, decode, fresh tensors per plan), as the general path makes them: the
door's checks; the batch's sizes (the lengths' max and sum, the dimensions); the storage
look-ups; staging (the compiled screen's fill and checks, the host pass, the one device
allocation, the one copy, the views, and what recycled memory costs instead of the last
two, ``planner.fresh_pool``); the device steps the host pass left, as the plan runs them
(a fused pair as one launch, ``planner.fusion``) and each alone; building the frozen
plans. Then what ``plan()`` runs for this batch, the eager lane (``planner.eager_lane``):
its whole plan, its one-pass door and its staging. The floors: a ``torch.empty`` of the
plan's buffer, an empty pinned ``copy_`` of the staged size, one ``split_with_sizes`` of
the buffer, and the hand-written eager path of ``planner_overhead`` (one tensor op or copy
per field).

    python3 -m benchmarks.eager_pieces --out $OUT/eager_pieces.json --plot $OUT/eager_pieces.png
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import torch

from backends.common.torch_ref import check_gather_token_slots, check_page_table_from_slots
from backends.nsa import NSAPlan  # noqa: F401  (registers the NSA backend)
from benchmarks.common import machine, num_sms_of, plot_bars, print_table, time_paired, write_json
from benchmarks.planner_overhead import HandWrittenNSA
from benchmarks.seed_stack import batch_of, make_batch, make_table
from planner import ForwardMode, Limits, Planner, device_copy
from planner.dims import lengths_max_sum
from planner.fusion import FusedSteps
from planner.lane_door import host_sources, table_on
from planner.materialise import run_steps
from planner.plan_build import build_plans

_DECODE = ForwardMode.DECODE


def _launch_paths(tensors, program, batch) -> dict[str, Callable[[int], Any]]:
    """The fused kernel's launch three ways: through ``triton.jit``'s run (what the plan
    does), through the compiled kernel's own ``[grid]`` launcher, and its launcher called
    with the stream and function at hand: how much of a launch is Triton's Python."""
    from backends.common import token_table_triton as tt

    by_op = {s.op_name: s for s in program.steps}
    gather, pages = by_op["gather_token_slots"], by_op["page_table"]
    slots, table = tensors[gather.output], tensors[pages.output]
    inputs = [tensors[k] for k in gather.input_keys]
    grid, args, kw = tt.launch_args(slots, table, *inputs, pages.params["page_size"])
    compiled = tt._token_table[grid](*args, **kw)
    every = (*args, *kw.values())
    index = slots.device.index
    raw_stream = torch._C._cuda_getCurrentRawStream
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    return {
        "    launch: triton.jit run": lambda i: tt._token_table[grid](*args, **kw),
        "    launch: CompiledKernel[grid]": lambda i: compiled[(*grid, 1)](*every),
        "    launch: its launcher, stream at hand": lambda i: run(
            grid[0], grid[1], 1, raw_stream(index), function, meta, None, None, None, *every
        ),
    }


def _staging_pieces(storage, batch, reqs, dims, ranges) -> dict[str, Callable[[int], Any]]:
    """What staging calls: the ring's next buffer, the compiled screen, the host pass, the
    allocation and copy (``stage`` whole), and cutting the views."""
    stager, layout = storage.stager, storage._layout(dims, reqs, storage.host_pass)
    tokens = dims["tokens"]
    extra = layout.part.staged_size - stager.layout.size
    total = stager.region_size(extra)
    scratch = torch.zeros(total, dtype=torch.int32)  # the screen's and pass's own: the ring's
    address = scratch.data_ptr()  # buffers may still be being sent
    staged = stager.stage(
        batch, reqs, tokens, ranges, read_device=True, extra=extra, device_extra=layout.device_extra
    )
    pieces: dict[str, Callable[[int], Any]] = {
        "  screen C call (fill and check)": lambda i, _alive=scratch: stager.layout.screen.run(
            address, batch, reqs, tokens, ranges, read_device=True
        ),
        "  stage() whole (fill, host pass, alloc, copy)": lambda i: stager.stage(
            batch,
            reqs,
            tokens,
            ranges,
            read_device=True,
            extra=extra,
            host_work=lambda view, at: layout.part.native.run(at),
            device_extra=layout.device_extra,
        ),
        "  views cut anew (one split, the 2-D views; recycled memory keeps them)": lambda i: (
            layout.staged.views(staged, {})
        ),
        "  recycled memory: take (the counts, the views held)": lambda i: storage.pool.take(layout),
    }
    kept = storage.pool.take(layout)
    if kept is not None:
        pieces["    its counts alone (nothing reads the memory)"] = lambda i: kept.unobserved()
    if stager._ring:  # pinned buffers on a GPU host; a fresh buffer per plan on the CPU
        pieces["  ring's next buffer (event wait)"] = lambda i: stager._next_cut(total)
    if layout.part.native is not None:
        pieces["  host pass C call"] = lambda i, _alive=scratch: layout.part.native.run(address)
    return pieces


def _lane_pieces(planner: Planner, batch) -> dict[str, Callable[[int], Any]]:
    """What the eager lane (``planner.eager_lane``, which ``plan()`` takes for this batch)
    does in place of the door, the sizes and the general staging: its one-pass checks, the
    lane's whole plan, and its staging through the bound screen."""
    lanes = planner._eager_lanes
    next_n = planner.program(_DECODE).next_n
    if lanes.plan(batch) is None:
        return {}
    lane = lanes._lanes[(_DECODE, batch.bs)]
    sources = host_sources(batch, next_n)
    seq, real, pool_kind, pool, slot_kind, slot, pos_kind, pos = sources
    table = batch.req_to_token
    ranges = planner.storages.ranges(_DECODE, table)
    bound = lane._bound_for(ranges)
    max_len, kv_tokens = lane.max_sum.int32(seq.data_ptr(), real)
    dims = planner.dims(_DECODE, real, max_len, real, kv_tokens)
    call = (seq.data_ptr(), pool_kind, pool, slot_kind, slot, pos_kind, pos, real)

    return {
        "eager lane: the whole plan (what plan() runs)": lambda i: lane.plan(batch, sources, table),
        "  lane door (one pass: checks, kinds, addresses)": lambda i: (
            host_sources(batch, next_n),
            table_on(table, planner.device, planner.device.type == "cpu"),
        ),
        "  lane staging (screen, host pass, copy; the launch too once a layout has its record)": lambda i: (
            lane.storage.prepare_screened(
                bound, call, batch, real, dims, ranges, read_table=lane.read_table
            )
        ),
    }


_HAND = "hand-written eager"
_GROWING = "plan() as a decode grows (+1 token a call)"
_HAND_GROWING = "hand-written eager as a decode grows"


def _growing(table, bs: int, context: int, calls: int, rng: random.Random) -> list:
    """A decode batch whose lengths grow by one token per call, as a serving loop's do: the
    longest request, and so the token slots' shape, changes every call, which the same
    batch planned again never shows. Each variant that plans it walks the list once."""
    start = [rng.randint(context - context // 8, context) - calls for _ in range(bs)]
    return [batch_of(table, [n + step for n in start]) for step in range(calls)]


def _walk(plan: Callable[[Any], Any], batches: list) -> Callable[[int], Any]:
    """A variant that plans the next of ``batches`` each call."""
    step = iter(batches).__next__
    return lambda i: plan(step())


def _pieces(planner: Planner, batch, grown: list) -> dict[str, Callable[[int], Any]]:
    """The whole plan and each call ``_plan_one`` makes, as it makes them for ``batch``."""
    program = planner.program(_DECODE)
    reqs = batch.bs
    max_len, kv_tokens = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
    dims = planner.dims(_DECODE, reqs, max_len, reqs, kv_tokens)
    ranges = planner.storages.ranges(_DECODE, batch.req_to_token)
    storage = planner.storages.fresh(_DECODE, reqs)
    tensors, done = storage.prepare(batch, reqs, dims, ranges, read_device=True)
    inputs = storage.batch_inputs(done)
    schedule = storage.schedule(done)
    device_steps = [s for s in program.steps if s.output not in done]
    handles = run_steps(schedule, tensors, batch, False, inputs=inputs)
    device = planner.device
    pieces: dict[str, Callable[[int], Any]] = {
        "plan() whole": lambda i: planner.plan(batch),
        _GROWING: _walk(planner.plan, grown),
        "door (validate_batch)": lambda i: planner._validate(batch, device_reads=True),
        "sizes (max/sum, dims)": lambda i: planner.dims(
            _DECODE, reqs, *lengths_max_sum(batch.seq_lens_cpu, 1)[:1], reqs, kv_tokens
        ),
        "storage look-ups": lambda i: (
            planner.storages.ranges(_DECODE, batch.req_to_token),
            planner.storages.fresh(_DECODE, reqs),
        ),
        "staging (fill, host pass, alloc, copy, views)": lambda i: storage.prepare(
            batch, reqs, dims, ranges, read_device=True
        ),
        "device steps (as run)": lambda i: run_steps(
            schedule, tensors, batch, False, inputs=inputs
        ),
        "build plans": lambda i: build_plans(program, tensors, handles, dims),
    }
    pieces.update(_staging_pieces(storage, batch, reqs, dims, ranges))
    pieces.update(_lane_pieces(planner, batch))
    for run in schedule:
        if isinstance(run, FusedSteps) and run.first.provider.name == run.fusion.provider:
            name = f"  fused {run.first.key} + {run.second.key} ({run.fusion.provider})"
            pieces[name] = lambda i, r=run: r.run(tensors, static=False)
            first, second = run.first, run.second
            pieces["    its checks (the references')"] = lambda i, a=first, b=second: (
                check_gather_token_slots(tensors[a.output], *[tensors[k] for k in a.input_keys]),
                check_page_table_from_slots(
                    tensors[b.output], tensors[b.input_keys[0]], b.params["page_size"]
                ),
            )
    if device.type == "cuda" and any(isinstance(r, FusedSteps) for r in schedule):
        pieces.update(_launch_paths(tensors, program, batch))
    for step in device_steps:  # one by one, as before the fusion and as captures run them
        pieces[f"  step {step.key} alone ({step.provider.name})"] = lambda i, s=step: s.run(
            tensors, static=False
        )
    return pieces


def _floors(
    planner: Planner, batch, grown: list, device: torch.device
) -> dict[str, Callable[[int], Any]]:
    storage = planner.storages.fresh(_DECODE, batch.bs)
    layout = next(iter(storage._layouts.values()))
    total = layout.part.sent + layout.device_extra
    host = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
    dev = torch.zeros(total, dtype=torch.int32, device=device)
    sizes = layout.staged.sizes
    hand = HandWrittenNSA(
        batch.bs, planner.limits.max_context, device, planner.limits.num_sms, 2048
    )
    return {
        "floor: torch.empty of the plan's buffer": lambda i: torch.empty(
            total, dtype=torch.int32, device=device
        ),
        "floor: empty pinned copy_": lambda i: dev.copy_(host, non_blocking=True),
        "floor: the same copy as one cudaMemcpyAsync": lambda i: device_copy.send(
            dev, host, total, device.index if device.index is not None else 0
        ),
        "floor: one split_with_sizes": lambda i: dev.split_with_sizes(sizes),
        _HAND: lambda i: hand.plan(batch),
        _HAND_GROWING: _walk(hand.plan, grown),
    }


def measure(args: argparse.Namespace, bs: int, device: torch.device) -> list[dict[str, Any]]:
    table, num_pages = make_table(bs, args.context, device, args.seed)
    rng = random.Random(args.seed + bs)
    batch = make_batch(table, bs, args.context, rng)
    limits = Limits(
        max_batch=bs,
        max_context=args.context,
        page_size=64,
        num_sms=num_sms_of(device),
        kv_slots=num_pages * 64,
        device=str(device),
    )
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
    planner.plan(batch)  # lays out this batch's shape and compiles what the steps launch
    grown = _growing(table, bs, args.context, args.warmup + args.iters, rng)
    variants = {**_pieces(planner, batch, grown), **_floors(planner, batch, grown, device)}
    timed = time_paired(
        variants, warmup=args.warmup, iters=args.iters, ratios_to=[_HAND, _HAND_GROWING]
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [{"bs": bs, "piece": name, **stats} for name, stats in timed.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG of the medians here (needs matplotlib)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = [row for bs in args.batches for row in measure(args, bs, device)]
    by = {(r["bs"], r["piece"]): r for r in rows}
    names = list(dict.fromkeys(r["piece"] for r in rows))
    table_rows = [
        [
            name,
            *[
                f"{by[(bs, name)]['median_us']:.1f} ({by[(bs, name)]['p99_us']:.0f})"
                if (bs, name) in by
                else "-"
                for bs in args.batches
            ],
        ]
        for name in names
    ]
    print_table(
        f"eager plan() pieces, median (p99) us, nsa decode, {device}",
        ["piece", *[f"bs {bs}" for bs in args.batches]],
        table_rows,
    )
    print_table(
        "plan() over the hand-written eager path on the same batches, median of per-call ratios"
        " (the target is <= 0.8)",
        ["batches", *[f"bs {bs}" for bs in args.batches]],
        [
            [
                label,
                *[f"{by[(bs, name)][f'ratio_to {hand}']:.3f}" for bs in args.batches],
            ]
            for label, name, hand in (
                ("one batch planned again", "plan() whole", _HAND),
                ("a decode growing a token a call", _GROWING, _HAND_GROWING),
            )
        ],
    )
    write_json(args.out, {"machine": machine(), "config": vars(args), "rows": rows})
    plot_bars(
        args.plot,
        "eager plan() pieces, nsa decode (median us)",
        names,
        {f"bs {bs}": [by[(bs, n)]["median_us"] for n in names] for bs in args.batches},
        "us",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
