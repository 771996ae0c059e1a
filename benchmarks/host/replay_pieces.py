#!/usr/bin/env python3
"""A ``replay()`` taken apart: each piece timed alone beside its floors, both ways inputs arrive.

Why: a profiler inflates Python calls and aten dispatch on a GPU host, so its breakdown
misleads about a path of tens of microseconds. Here each piece ``Planner.replay`` runs is
called alone, interleaved call by call with the whole replay and the floors
(``time_paired``: the host's drift falls on all alike), so the table shows how far each
piece is from its floor and what the replay spends outside its pieces (derived).

The pieces (one captured decode size per batch size), as ``replay()`` makes them: the door's
checks; the batch written into the staging slot (``planner.step_inputs.write_batch``, here
into a buffer of its own); the transfer (``Stager.send``), by the copy (``CopyTransport``:
one asynchronous copy out of the slot and its event) or by the graph's pull
(``graphs.PulledTransport``: the slot's tag published for the pull; no graph is launched
here, so every replay refills one slot, the host's cost without a wait); the device check,
where it runs outside the graph (a host op reads the staged values); the host ops, where the
backends have any (FlashInfer's ``plan``); the pointer check
(``CapturedStep.check_unmoved``). The floors: an empty pinned ``copy_`` of the staged size
and a ``data_ptr()`` over every plan tensor.

    python3 -m benchmarks replay_pieces --out $OUT/replay_pieces.json --plot $OUT/replay_pieces.png
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

import backends  # noqa: F401  (registers the backends)
from benchmarks.common import machine, num_sms_of, plot_bars, print_table, time_paired, write_json
from graphs import PulledTransport
from planner import ForwardMode, Limits, Planner
from planner.captured import run_steps
from planner.step_inputs import StepInputs, write_batch
from tests.support.batches import make_pool, random_batch

GPU_STEPS = {
    "": "--out {out}/replay_pieces.json --plot {out}/replay_pieces.png",
}

_DECODE = ForwardMode.DECODE
Variants = dict[str, Callable[[int], Any]]
TRANSPORTS = {"copy": None, "pulled": PulledTransport}
PARTS = ("door", "write slot", "transfer", "device check", "host ops", "pointer check")
"""What each replay is summed from, by name (after its transport's prefix)."""


def pieces(planner: Planner, batch, bs: int, prefix: str) -> Variants:
    """The whole replay and each call it makes, as it makes them for ``batch``."""
    captured = planner._captured[(_DECODE, bs)]
    stager, debug = captured.stager, planner.debug
    first = captured.steps[0]
    now = not captured.checks_in_graph
    tokens = batch.out_cache_loc.shape[0]
    # the write's own buffer: the slot may still be in a copy, or a pull's
    scratch = StepInputs(torch.zeros(stager.layout.size, dtype=torch.int32), stager.layout)

    def transfer(i: int) -> None:
        stager.inputs()
        stager.send(now=now)

    out: Variants = {
        "replay() whole": lambda i: planner.replay(batch, bs),
        "door": lambda i: planner._validate(batch, device_reads=debug),
        "write slot": lambda i: write_batch(scratch, batch, tokens),
        "transfer": transfer,
        "pointer check": lambda i: first.check_unmoved(first.handles),
    }
    if now:
        out["device check"] = lambda i: first.check_inputs(captured.check, captured.error)
    if captured.host_steps:
        out["host ops"] = lambda i: run_steps(
            captured.host_steps, first.tensors, batch, static=True
        )
    return {f"{prefix}: {name}": fn for name, fn in out.items()}


def floors(planner: Planner, bs: int, device: torch.device) -> Variants:
    captured = planner._captured[(_DECODE, bs)]
    size = captured.stager.words
    host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
    dev = torch.zeros(size, dtype=torch.int32, device=device)
    tensors = [t for step in captured.steps for _, t in step.named]
    data_ptr = torch.Tensor.data_ptr
    return {
        "floor: empty pinned copy_ of the staged size": lambda i: dev.copy_(
            host, non_blocking=True
        ),
        "floor: data_ptr() over the plan tensors": lambda i: list(map(data_ptr, tensors)),
    }


def measure(
    args: argparse.Namespace, bs: int, device: torch.device, group: list[str]
) -> list[dict[str, Any]]:
    """The rows of one batch size of one backend group, both transports interleaved."""
    table = make_pool(bs + 1, args.context, 64).to(device)
    limits = Limits(
        max_batch=bs,
        max_context=args.context,
        num_sms=num_sms_of(device),
        kv_slots=int(table.max()) + 1,
        device=str(device),
    )
    options = {"nsa": {"topk": 2048}} if "nsa" in group else {}
    rng = random.Random(bs)
    batch = random_batch(rng, table.cpu(), max_batch=bs, max_context=args.context, bs=bs)
    batch = dataclasses.replace(batch, req_to_token=table)
    variants: Variants = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, transport in TRANSPORTS.items():
            planner = Planner(group, limits, options=options, debug=False, transport=transport)
            planner.capture(bs, req_to_token=table)
            planner.replay(batch, bs)
            variants.update(pieces(planner, batch, bs, name))
        variants.update(floors(planner, bs, device))
        timed = time_paired(variants, warmup=args.warmup, iters=args.iters)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [
        {"group": "+".join(group), "bs": bs, "piece": name, **stats}
        for name, stats in timed.items()
    ]


def print_group(rows: list[dict[str, Any]], group: str, batches: list[int], device) -> None:
    """One group's table: each piece, then what each replay spends outside its pieces
    (derived: its median less theirs)."""
    by = {(r["bs"], r["piece"]): r for r in rows if r["group"] == group}
    names = list(dict.fromkeys(r["piece"] for r in rows if r["group"] == group))
    out = [
        [
            name,
            *[
                f"{by[(bs, name)]['median_us']:.2f} ({by[(bs, name)]['p99_us']:.1f})"
                for bs in batches
            ],
        ]
        for name in names
    ]
    for prefix in TRANSPORTS:  # the replay's own work: its median less its pieces'
        parts = [f"{prefix}: {n}" for n in PARTS]
        left = [
            by[(bs, f"{prefix}: replay() whole")]["median_us"]
            - sum(by[(bs, n)]["median_us"] for n in parts if (bs, n) in by)
            for bs in batches
        ]
        out.append(
            [f"{prefix}: replay() outside its pieces (derived)", *[f"{v:.2f}" for v in left]]
        )
    width = max(len(row[0]) for row in out)
    print_table(
        f"replay() pieces, median (p99) us, {group} decode, {device}",
        ["piece", *[f"bs {bs}" for bs in batches]],
        [[row[0].ljust(width), *row[1:]] for row in out],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--backends", nargs="+", default=["paged", "nsa"])
    p.add_argument(
        "--flashinfer",
        nargs="*",
        default=["flashinfer_decode", "flashinfer_mla"],
        help="FlashInfer backends split too, each on its own (none: leave them out)",
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
    rows, skipped = [], {}
    for group in [args.backends, *[[b] for b in args.flashinfer]]:
        try:
            rows += [row for bs in args.batches for row in measure(args, bs, device, group)]
        except Exception as exc:  # a FlashInfer backend not usable here: say so, keep going
            if group is args.backends:
                raise
            skipped[group[0]] = f"{type(exc).__name__}: {exc}"
    for group in dict.fromkeys(r["group"] for r in rows):
        print_group(rows, group, args.batches, device)
    for backend, why in skipped.items():
        print(f"{backend}: not measured ({why})")
    write_json(
        args.out, {"machine": machine(), "config": vars(args), "rows": rows, "skipped": skipped}
    )
    first = [r for r in rows if r["group"] == rows[0]["group"]]
    names = list(dict.fromkeys(r["piece"] for r in first))
    by = {(r["bs"], r["piece"]): r["median_us"] for r in first}
    try:
        plot_bars(
            args.plot,
            f"replay() pieces, {rows[0]['group']} decode, {device} (median us)",
            names,
            {f"bs {bs}": [by[(bs, n)] for n in names] for bs in args.batches},
            "us",
        )
    except ImportError:
        print("--plot: matplotlib is not installed here; no plot written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
