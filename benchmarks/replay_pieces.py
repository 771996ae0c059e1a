#!/usr/bin/env python3
"""A screened replay taken apart: each piece of ``Planner.replay()`` timed on its own, beside
the floors of the CUDA calls it makes.

Why: cProfile and torch.profiler inflate Python calls and aten dispatch by 2-3x on the GPU
host, so their breakdowns mislead about a 30 us path. Here every piece is called alone,
interleaved call by call with the whole replay and the floors (``time_paired``: the host's
drift falls on all alike), and the table shows what the lane spends outside the calls it
makes, and how far each call is from its floor.

The FlashInfer replays (``--flashinfer``) are split the same way: the host op through the
planner, the slot's plan, the host arrays' fill, the summary copy and the scheduler call,
beside the bare FlashInfer ``plan()`` of the same arrays.

The pieces (paged + nsa, decode, one captured size per batch size): the replay lane's
whole run, and each call it makes: the next ring buffer (its event wait), the compiled
screen's fill and check, the staging copy with its event record, the pointer identity
check, and the bookkeeping replay() adds around the lane; what is left of the lane's run
is its own checks and reads of the batch. The general path's door is timed beside it, for scale (a lane replay does not run
it). The floors: an empty pinned ``copy_`` of the same
size, an event record on the current stream, a synchronize on a finished event, a
``data_ptr()`` loop over the plan tensors, and a ctypes call of a C function that returns.

    python3 -m benchmarks.replay_pieces --out $OUT/replay_pieces.json --plot $OUT/pieces.png
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import machine, num_sms_of, plot_bars, print_table, time_paired, write_json
from planner import ForwardMode, Limits, Planner, device_copy
from planner.cuda_events import record_on_current_stream
from planner.staging_screen import K_DERIVED, K_I32, K_I64
from tests.support.batches import make_pool, random_batch

_DECODE = ForwardMode.DECODE


def _pieces(planner: Planner, batch, bs: int) -> dict[str, Callable[[int], Any]]:
    """The whole replay, the lane's run, and each call the lane makes, as it makes them."""
    lane = planner._lanes[(_DECODE, bs)]
    captured, stager = lane.captured, lane.stager
    # the screen fills a scratch buffer of its own: the ring's may still be being sent
    scratch = torch.zeros_like(stager.host, pin_memory=stager.host.is_pinned())
    address = scratch.data_ptr()
    seq, pool, slot = batch.seq_lens_cpu, batch.req_pool_indices, batch.out_cache_loc
    kinds = {torch.int32: K_I32, torch.int64: K_I64}
    args = (seq.data_ptr(), kinds[pool.dtype], pool.data_ptr(), kinds[slot.dtype])
    args += (slot.data_ptr(), K_DERIVED, 0, batch.bs)  # positions left out
    ring, step = stager._ring, captured.steps[0]
    stats = planner.stats
    return {
        "replay() whole": lambda i: planner.replay(batch, bs),
        "lane run": lambda i: lane.run(batch),
        "ring buffer (event wait)": lambda i: stager.next_host(),
        # the default argument keeps the scratch buffer alive as long as the lambda
        "screen C call": lambda i, _alive=scratch: lane.screen.run(address, *args),
        "copy + ring events": lambda i: stager.send(ring[0][0], stager.device_buf, ring[0][2]),
        "pointer check": lambda i: step.check_unmoved({}),
        # what replay() adds around the lane: the counters and the time (the lane marks)
        "bookkeeping": lambda i: stats.count_replay(_DECODE, lane.steps, 0.0),
        "general path's door (not run)": lambda i: planner._validate(batch, device_reads=False),
    }


def _pulled_pieces(backends, limits: Limits, table, batch, bs: int) -> dict[str, Callable]:
    """The same replay where the graph pulls the staged inputs itself (``staging_in_graph``):
    no copy, no events. Without a graph launch the ring stays at one step, so each call
    refills the same slot: the host cost a serving loop pays, without its wait (none in a
    loop that syncs each step)."""
    planner = Planner(backends, limits, options={"nsa": {"topk": 2048}}, staging_in_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.capture(bs, req_to_token=table)
    lane = planner._lanes[(_DECODE, bs)]
    if lane.pull is None or not lane.run(batch):
        raise SystemExit(f"bs {bs}: the staged-in-graph replay does not pull; nothing to time")
    pull = lane.pull
    pieces: dict[str, Callable[[int], Any]] = {
        "in graph: replay() whole": lambda i: planner.replay(batch, bs),
        "in graph: lane run": lambda i: lane.run(batch),
        "in graph: slot and tag (ack check)": lambda i: (pull.slot(), pull.publish(sent=False)),
    }
    device = limits.torch_device
    if device.type == "cuda":
        pieces["in graph: device sync, then replay()"] = lambda i: (
            torch.cuda.synchronize(device),
            planner.replay(batch, bs),
        )
    return pieces


def _floors(planner: Planner, bs: int, device: torch.device) -> dict[str, Callable[[int], Any]]:
    captured = planner._captured[(_DECODE, bs)]
    stager = captured.storages[0].stager
    host = torch.zeros_like(stager.host, pin_memory=device.type == "cuda")
    dev = torch.zeros_like(stager.device_buf)
    tensors = [t for plan in captured.plans.values() for t in plan.tensors().values()]
    libc = ctypes.CDLL(None)
    noop = libc.abs  # a C function that returns at once: the cost of a ctypes call
    noop.argtypes, noop.restype = [ctypes.c_int], ctypes.c_int
    floors: dict[str, Callable[[int], Any]] = {
        "floor: empty pinned copy_": lambda i: dev.copy_(host, non_blocking=True),
        "floor: the same copy as one cudaMemcpyAsync": lambda i: device_copy.send(
            dev, host, host.shape[0], device.index if device.index is not None else 0
        ),
        "floor: data_ptr() loop": lambda i: [t.data_ptr() for t in tensors],
        "floor: ctypes call": lambda i: noop(1),
    }
    if device.type == "cuda":
        event, done = torch.cuda.Event(), torch.cuda.Event()
        done.record()
        torch.cuda.synchronize(device)
        floors["floor: event record"] = lambda i: record_on_current_stream(event, device.index)
        floors["floor: finished event synchronize"] = lambda i: done.synchronize()
    return floors


def _flashinfer_pieces(planner: Planner, batch, bs: int, backend: str) -> dict[str, Callable]:
    """A FlashInfer replay: the whole, its host op, and the host op's own calls; the bare
    ``plan()`` of the same arrays (what engines call) as the floor."""
    lane = planner._lanes[(_DECODE, bs)]
    captured = lane.captured
    plan = planner.replay(batch, bs)[backend]
    # the host op's output (its summary) and the slot its handle names
    (step,) = [step for step in captured.host_steps if step.backend == backend]
    slot, out = plan.wrapper.slot, captured.steps[0].tensors[step.output]
    seq, c = batch.seq_lens_cpu, slot.config
    pieces: dict[str, Callable[[int], Any]] = {
        "replay() whole": lambda i: planner.replay(batch, bs),
        "lane run": lambda i: lane.run(batch),
        "host op through the planner (run_host_ops)": lambda i: captured.run_host_ops(batch),
        "the slot's plan (fill, scheduler, summary copy, events)": lambda i: slot.plan(
            seq, slot.args.capacity, plan.kv_indices, out
        ),
        "host arrays fill (C)": lambda i: slot.args.fill(seq, bs, c.page_size, c.next_n),
        "summary copy_": lambda i: out.copy_(slot.args.summary, non_blocking=True),
    }
    if slot.direct is not None:
        pieces["scheduler call alone"] = lambda i: slot.direct(slot.args)
    if slot.wrapper is not None:
        pieces["floor: bare FlashInfer plan()"] = lambda i: slot._plan_wrapper(plan.kv_indices)
    return pieces


def measure(
    args: argparse.Namespace, bs: int, device: torch.device, backend: str | None = None
) -> list[dict[str, Any]]:
    """The rows of one batch size: the paged + nsa lane (``backend`` None) or a FlashInfer
    backend's replay."""
    table = make_pool(bs + 1, args.context, 64).to(device)
    limits = Limits(
        max_batch=bs,
        max_context=args.context,
        num_sms=num_sms_of(device),
        kv_slots=int(table.max()) + 1,
        device=str(device),
    )
    backends = args.backends if backend is None else [backend]
    planner = Planner(backends, limits, options={"nsa": {"topk": 2048}} if backend is None else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.capture(bs, req_to_token=table)
    rng = random.Random(bs)
    batch = random_batch(rng, table.cpu(), max_batch=bs, max_context=args.context, bs=bs)
    batch = dataclasses.replace(batch, req_to_token=table)
    lane = planner._lanes.get((_DECODE, bs))
    if lane is None or not lane.run(batch):
        raise SystemExit(f"bs {bs}: the replay does not take the lane; nothing to split")
    if backend is None:
        variants = {**_pieces(planner, batch, bs), **_floors(planner, bs, device)}
        variants.update(_pulled_pieces(backends, limits, table, batch, bs))
        if device.type == "cuda":  # what a serving loop sees: each step starts after a sync
            variants["device sync, then replay()"] = lambda i: (
                torch.cuda.synchronize(device),
                planner.replay(batch, bs),
            )
            variants["floor: device sync alone"] = lambda i: torch.cuda.synchronize(device)
    else:
        variants = _flashinfer_pieces(planner, batch, bs, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed = time_paired(variants, warmup=args.warmup, iters=args.iters)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    group = backend or "+".join(args.backends)
    return [{"group": group, "bs": bs, "piece": name, **stats} for name, stats in timed.items()]


def _print_group(rows: list[dict[str, Any]], group: str, batches: list[int], device) -> None:
    by = {(r["bs"], r["piece"]): r for r in rows if r["group"] == group}
    names = list(dict.fromkeys(r["piece"] for r in rows if r["group"] == group))
    table_rows = []
    for name in names:
        cells = [
            f"{by[(bs, name)]['median_us']:.2f} ({by[(bs, name)]['p99_us']:.1f})"
            if (bs, name) in by
            else "-"
            for bs in batches
        ]
        table_rows.append([name, *cells])
    calls = ("ring buffer (event wait)", "screen C call", "copy + ring events")
    calls += ("pointer check",)
    if all((bs, n) in by for bs in batches for n in calls):
        # what the lane spends outside the calls it makes: the batch's checks and reads
        derived = []
        for bs in batches:
            lane = by[(bs, "lane run")]["median_us"]
            derived.append(f"{lane - sum(by[(bs, n)]['median_us'] for n in calls):.2f}")
        table_rows.append(["lane's own checks, reads and marks (derived)", *derived])
    for label, name in (
        ("", "device sync, then replay()"),
        ("in graph: ", "in graph: device sync, then replay()"),
    ):
        synced = (name, "floor: device sync alone")
        if all((bs, n) in by for bs in batches for n in synced):
            after = [
                by[(bs, synced[0])]["median_us"] - by[(bs, synced[1])]["median_us"]
                for bs in batches
            ]
            table_rows.append(
                [
                    f"{label}replay() right after a device sync (derived)",
                    *[f"{a:.2f}" for a in after],
                ]
            )
    print_table(
        f"replay() pieces, median (p99) us, {group} decode, {device}",
        ["piece", *[f"bs {bs}" for bs in batches]],
        table_rows,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--backends", nargs="+", default=["paged", "nsa"])
    p.add_argument(
        "--flashinfer",
        nargs="*",
        default=["flashinfer_decode", "flashinfer_mla"],
        help="FlashInfer backends whose replays are split too (none: leave them out)",
    )
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG of the medians here (needs matplotlib)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows = [row for bs in args.batches for row in measure(args, bs, device)]
    for backend in args.flashinfer:
        rows += [row for bs in args.batches for row in measure(args, bs, device, backend)]
    for group in dict.fromkeys(r["group"] for r in rows):
        _print_group(rows, group, args.batches, device)
    write_json(args.out, {"machine": machine(), "config": vars(args), "rows": rows})
    first = [r for r in rows if r["group"] == rows[0]["group"]]
    names = list(dict.fromkeys(r["piece"] for r in first))
    by = {(r["bs"], r["piece"]): r["median_us"] for r in first}
    plot_bars(
        args.plot,
        f"replay() pieces, {rows[0]['group']} (median us)",
        names,
        {f"bs {bs}": [by[(bs, n)] for n in names] for bs in args.batches},
        "us",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
