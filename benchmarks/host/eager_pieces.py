#!/usr/bin/env python3
"""An eager ``plan()`` taken apart: each piece timed alone, beside its floors and hand-written code.

Why: a profiler spreads an eager plan over many small Python calls and inflates each of
them on a GPU host, so its breakdown misleads about a path of tens of microseconds. Here
each piece ``Planner.plan`` runs is called alone, interleaved call by call with the whole
plan, the floors and the hand-written code (``time_paired``: the host's drift falls on all
alike), for one batch planned again and for a decode whose lengths grow a token a call
(what a serving loop with graphs off plans: a new longest request, so a new layout, every
call).

The pieces (nsa, decode), as ``Planner._plan_one`` makes them: the door's checks; the
dimensions (the lengths' max and sum); staging (``FreshStorage.stage``: one int32 arena for
the raw inputs, the error word and the fields, the batch written into the raw inputs (alone:
``write_batch`` into a host buffer of its own) and sent); the device check of the raw
inputs (``InputCheck.run``) and the read of its error word (the one synchronisation); the
device steps (each op's launch alone, too); building the frozen plans. What each whole
spends outside its pieces is derived. The floors: a ``torch.empty`` of the plan's int32
arena, an empty pinned host-to-device copy of the raw inputs' size, one Triton launch (where
Triton runs), and ``HandWrittenNSA.plan`` of ``planner_overhead`` (one tensor op or copy per
field).

    python3 -m benchmarks eager_pieces --out $OUT/eager_pieces.json --plot $OUT/eager_pieces.png
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import torch

from backends.common.triton_kernels import _uniform_offsets, triton_available
from backends.nsa import NSAPlan  # noqa: F401  (registers the NSA backend)
from benchmarks.common import machine, num_sms_of, plot_bars, print_table, time_paired, write_json
from benchmarks.host.planner_overhead import HandWrittenNSA
from benchmarks.kernels.seed_stack import batch_of, make_batch, make_table
from planner import ForwardMode, Limits, Planner
from planner.captured import run_steps
from planner.checks import lengths_max_sum
from planner.plans import build_plans
from planner.step_inputs import StepInputs, write_batch

GPU_STEPS = {
    "": "--out {out}/eager_pieces.json --plot {out}/eager_pieces.png",
}

_DECODE = ForwardMode.DECODE
Variants = dict[str, Callable[[int], Any]]

WHOLE, GROWING = "plan() whole", "plan() as a decode grows (+1 token a call)"
HAND, HAND_GROWING = "hand-written eager", "hand-written eager as a decode grows"
PLAN_PARTS = (
    "door",
    "dims",
    "stage()",
    "device check",
    "error read",
    "device steps",
    "build plans",
)
STAGE_PARTS = ("write inputs",)
"""The pieces each whole is summed from, by name (indented under it in the table)."""


def growing(table: torch.Tensor, bs: int, context: int, calls: int, rng: random.Random) -> list:
    """``calls`` decode batches of ``bs`` requests whose lengths grow a token a call."""
    if calls > context // 2:
        raise SystemExit(f"--context {context} is too short for {calls} growing calls")
    start = [rng.randint(context // 2, context - calls) for _ in range(bs)]
    return [batch_of(table, [n + i for n in start]) for i in range(calls)]


def walk(plan: Callable[[Any], Any], batches: list) -> Callable[[int], Any]:
    """A variant that plans the next of ``batches`` each call (time_paired calls each
    variant warmup + iters times: each batch once)."""
    step = iter(batches).__next__
    return lambda i: plan(step())


def pieces(planner: Planner, batch) -> tuple[Variants, Variants]:
    """Each call ``plan()`` makes for ``batch``, as it makes them; and its floors."""
    program, reqs, device = planner.program(_DECODE), batch.bs, planner.device
    max_len, kv_tokens = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
    tokens = reqs * program.next_n
    dims = planner.dims(_DECODE, reqs, max_len, tokens, kv_tokens)
    storage = planner.storages.fresh(_DECODE)
    real_tokens = batch.out_cache_loc.shape[0]
    table = batch.req_to_token
    tensors, region, error = storage.stage(batch, real_tokens, dims)
    check = planner.storages.check(_DECODE, table, static=False)
    outputs = storage.outputs(tensors)
    check.run(region, reqs, dims["tokens"], table, error, outputs)  # the source fields
    handles = run_steps(program.steps, tensors, batch, static=False)
    whole = region.untyped_storage().nbytes() // region.element_size()  # the int32 arena
    raw = storage.layout.size
    # the write's own buffer: a stage()'s may still be in its copy
    scratch = StepInputs(torch.zeros(raw, dtype=torch.int32), storage.layout)

    def sizes(i: int) -> dict[str, int]:
        longest, kv = lengths_max_sum(batch.seq_lens_cpu, program.next_n)
        return planner.dims(_DECODE, reqs, longest, tokens, kv)

    out: Variants = {
        "door": lambda i: planner._validate(batch, device_reads=True),
        "dims": sizes,
        "stage()": lambda i: storage.stage(batch, real_tokens, dims),
        "write inputs": lambda i: write_batch(scratch, batch, real_tokens),
        "device check": lambda i: check.run(region, reqs, dims["tokens"], table, error, outputs),
        "error read": lambda i: error.tolist(),
        "device steps": lambda i: run_steps(program.steps, tensors, batch, static=False),
    }
    for s in program.steps:
        out[f"launch {s.key} ({s.provider.name})"] = lambda i, s=s: s.run(tensors, static=False)
    out["build plans"] = lambda i: build_plans(program, tensors, handles, dims)
    pinned = torch.zeros(raw, dtype=torch.int32, pin_memory=device.type == "cuda")
    target = torch.zeros(raw, dtype=torch.int32, device=device)
    floors: Variants = {
        "floor: torch.empty of the plan's int32 arena": lambda i: torch.empty(
            whole, dtype=torch.int32, device=device
        ),
        "floor: empty pinned copy_ of the raw inputs' size": lambda i: target.copy_(
            pinned, non_blocking=True
        ),
    }
    if triton_available(device):
        offsets = torch.empty(64, dtype=torch.int32, device=device)
        floors["floor: one Triton launch (uniform_offsets)"] = lambda i: _uniform_offsets.launch(
            (1,), offsets, 64, 1, BLOCK=64
        )
    return out, floors


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
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}}, debug=False)
    planner.plan(batch)  # compiles what the steps launch
    grown = growing(table, bs, args.context, args.warmup + args.iters, rng)
    hand = HandWrittenNSA(bs, args.context, device, limits.num_sms, 2048)
    parts, floors = pieces(planner, batch)
    variants = {
        WHOLE: lambda i: planner.plan(batch),
        GROWING: walk(planner.plan, grown),
        **parts,
        **floors,
        HAND: lambda i: hand.plan(batch),
        HAND_GROWING: walk(hand.plan, grown),
    }
    timed = time_paired(
        variants, warmup=args.warmup, iters=args.iters, ratios_to=[HAND, HAND_GROWING]
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [{"bs": bs, "piece": name, **stats} for name, stats in timed.items()]


def depth(name: str) -> int:
    """How far a piece sits under ``plan()`` in the table."""
    if name in PLAN_PARTS:
        return 1
    return 2 if name in STAGE_PARTS or name.startswith("launch ") else 0


def table_rows(rows: list[dict[str, Any]], batches: list[int]) -> list[list[str]]:
    """One row per piece, each under its whole, then what each whole spends outside its
    pieces (derived: its median less theirs)."""
    by = {(r["bs"], r["piece"]): r for r in rows}
    names = list(dict.fromkeys(r["piece"] for r in rows))

    def cell(bs: int, name: str) -> str:
        r = by.get((bs, name))
        return "-" if r is None else f"{r['median_us']:.1f} ({r['p99_us']:.0f})"

    def outside(whole: str, parts: tuple[str, ...]) -> list[str]:
        left = []
        for bs in batches:
            inside = sum(by[(bs, n)]["median_us"] for n in parts if (bs, n) in by)
            left.append(f"{by[(bs, whole)]['median_us'] - inside:.1f}")
        return left

    out = [["  " * depth(n) + n, *[cell(bs, n) for bs in batches]] for n in names]
    out.append(["plan() outside its pieces (derived)", *outside(WHOLE, PLAN_PARTS)])
    out.append(["stage() outside its pieces (derived)", *outside("stage()", STAGE_PARTS)])
    width = max(len(row[0]) for row in out)  # left-aligned, so the indents show
    return [[row[0].ljust(width), *row[1:]] for row in out]


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
    head = ["piece", *[f"bs {bs}" for bs in args.batches]]
    print_table(
        f"eager plan() pieces, median (p99) us, nsa decode, {device}",
        head,
        table_rows(rows, args.batches),
    )
    by = {(r["bs"], r["piece"]): r for r in rows}
    print_table(
        "plan() over the hand-written eager path on the same batches, median of per-call ratios",
        ["batches", *head[1:]],
        [
            [label, *[f"{by[(bs, name)][f'ratio_to {hand}']:.3f}" for bs in args.batches]]
            for label, name, hand in (
                ("one batch planned again", WHOLE, HAND),
                ("a decode growing a token a call", GROWING, HAND_GROWING),
            )
        ],
    )
    write_json(args.out, {"machine": machine(), "config": vars(args), "rows": rows})
    names = list(dict.fromkeys(r["piece"] for r in rows))
    try:
        plot_bars(
            args.plot,
            f"eager plan() pieces, nsa decode, {device} (median us)",
            names,
            {f"bs {bs}": [by[(bs, n)]["median_us"] for n in names] for bs in args.batches},
            "us",
        )
    except ImportError:
        print("--plot: matplotlib is not installed here; no plot written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
