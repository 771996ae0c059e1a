#!/usr/bin/env python3
"""Host time the planner adds per step, beside metadata code written the way engines write it.

For each batch size: host time (no device sync, median of ``--iters``) of
  - ``plan()``: eager plans in fresh tensors (full validation), and the same with the
    host pass in numpy instead of C (the two interleaved call by call);
  - ``replay()`` with the ops recorded in the graph (what a graph step pays on the host);
  - ``replay()`` with the ops outside the graph (``ops_in_graph=False``: the seed's way);
  - hand-written: the same NSA metadata as per-field tensor ops and copies into
    static buffers (one host-to-device copy per input, a gather, a cumsum, a
    clamp, the schedule call), as engines write their replay paths today;
  - hand-written eager: the same into fresh tensors.
Plus target-verify replays (``next_n`` 2), an eager extend plan of one 2048-token chunk,
and the FlashInfer plans where that backend and flashinfer are usable, each beside the
bare FlashInfer ``plan()`` call of the same batch (the host op as engines call it) and the
compiled scheduler call alone that a graph slot's replay makes instead (its floor).
Medians and p99 of ``--iters`` calls after ``--warmup``.

    python3 -m benchmarks.planner_overhead --out $OUT/planner_overhead.json --plot $OUT/planner_overhead.png
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import warnings
from typing import Any
from unittest import mock

import torch

from backends.deepgemm import _native, reference_paged_mqa_schedule
from backends.nsa import NSAPlan  # noqa: F401  (registers the NSA backend)
from benchmarks.common import (
    machine,
    num_sms_of,
    plot_bars,
    print_table,
    sync,
    time_host,
    time_paired,
    write_json,
)
from benchmarks.seed_stack import make_batch, make_table
from planner import ForwardBatch, ForwardMode, Limits, Planner, native

GENERIC_OPS = (
    "causal_lengths",
    "uniform_offsets",
    "cumsum_with_zero",
    "gather_token_slots",
    "page_table",
    "clamp",
)


class HandWrittenNSA:
    """NSA metadata the way engine code does it today: one tensor op or copy per field."""

    def __init__(
        self, max_bs: int, max_ctx: int, device: torch.device, sms: int, topk: int
    ) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.device, self.sms, self.topk, self.max_ctx = device, sms, topk, max_ctx
        self.seq_lens = torch.ones(max_bs, **i32)
        self.req_pool = torch.zeros(max_bs, **i32)
        self.out_loc = torch.zeros(max_bs, **i32)
        self.positions = torch.zeros(max_bs, **i32)
        self.cu_k = torch.zeros(max_bs + 1, **i32)
        self.page_table = torch.zeros(max_bs, -(-max_ctx // 64), **i32)
        self.topk_lens = torch.ones(max_bs, **i32)
        self.schedule = torch.zeros(sms + 1, 2, **i32)

    def _schedule(self, lens: torch.Tensor) -> torch.Tensor:

        dg = _native.load() if lens.is_cuda else None
        if dg is not None:
            return dg.get_paged_mqa_logits_metadata(lens, 64, self.sms)
        return reference_paged_mqa_schedule(lens, 64, self.sms, check_values=False)

    def replay(self, batch, bs: int) -> None:
        n = batch.bs
        self.seq_lens[:n].copy_(batch.seq_lens_cpu, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.req_pool[:n].copy_(batch.req_pool_indices, non_blocking=True)
        self.req_pool[n:bs].fill_(0)
        self.out_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        torch.cumsum(self.seq_lens[:bs], 0, out=self.cu_k[1 : bs + 1])
        slots = batch.req_to_token[self.req_pool[:bs].long(), : self.max_ctx]
        self.page_table[:bs].copy_(slots[:, ::64] // 64)
        torch.clamp(self.seq_lens[:bs], max=self.topk, out=self.topk_lens[:bs])
        self.schedule.copy_(self._schedule(self.seq_lens[:bs].view(-1, 1)))

    def plan(self, batch) -> dict[str, torch.Tensor]:
        dev = self.device
        seq = batch.seq_lens_cpu.to(dev, non_blocking=True)
        pool = batch.req_pool_indices.to(dev, non_blocking=True)
        width = int(batch.seq_lens_cpu.max())
        cu = torch.nn.functional.pad(torch.cumsum(seq, 0, dtype=torch.int32), (1, 0))
        slots = batch.req_to_token[pool.long(), :width]
        return {
            "seq_lens": seq,
            "req_pool": pool,
            "out_loc": batch.out_cache_loc.to(dev, non_blocking=True),
            "positions": batch.positions.to(dev, non_blocking=True),
            "cu_k": cu,
            "page_table": slots[:, ::64] // 64,
            "topk_lens": seq.clamp(max=self.topk),
            "schedule": self._schedule(seq.view(-1, 1)),
        }


def measure(args, batch_size: int, device: torch.device) -> dict[str, Any]:

    sms = num_sms_of(device)
    table, num_pages = make_table(batch_size, args.context, device, args.seed)
    rng = random.Random(args.seed)
    batches = [make_batch(table, batch_size, args.context, rng) for _ in range(8)]
    limits = Limits(
        max_batch=batch_size,
        max_context=args.context,
        page_size=64,
        num_sms=sms,
        kv_slots=num_pages * 64,
        device=str(device),
    )
    out: dict[str, Any] = {"batch": batch_size}
    kw = dict(warmup=args.warmup, iters=args.iters)
    planner = planner_copy = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
    planner.capture(batch_size, req_to_token=table)
    outside = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}}, ops_in_graph=False)
    outside.capture(batch_size, req_to_token=table)
    # The host pass in numpy (its C form unavailable) on a planner of its own: every layout
    # it will use is made in this warm-up, while the C form is hidden.
    with mock.patch.object(native, "host_pass_runner", lambda: None):
        numpy_twins = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
        for b in batches:
            numpy_twins.plan(b)

    out["replay_ops_in_graph"] = time_host(
        lambda i: planner.replay(batches[i % 8], batch_size), **kw
    )
    sync(device)
    out["replay_ops_outside"] = time_host(
        lambda i: outside.replay(batches[i % 8], batch_size), **kw
    )
    sync(device)
    # The two eager variants interleaved call by call: their ratio is what this host's
    # drift between blocks of calls cannot move.
    out.update(
        time_paired(
            {
                "plan": lambda i: planner.plan(batches[i % 8]),
                "plan_numpy_twins": lambda i: numpy_twins.plan(batches[i % 8]),
            },
            **kw,
        )
    )
    sync(device)
    # The same eager plan with every generic op forced to its torch reference (no Triton launches).
    forced = {op: "torch" for op in GENERIC_OPS}
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}}, providers=forced)
    out["plan_torch_ops"] = time_host(lambda i, p=planner: p.plan(batches[i % 8]), **kw)
    sync(device)
    hand = HandWrittenNSA(batch_size, args.context, device, sms, 2048)
    out["hand_replay"] = time_host(lambda i: hand.replay(batches[i % 8], batch_size), **kw)
    sync(device)
    # The hand-written replay beside ours, both ways of staging, interleaved call by call. The
    # pulled replay without a graph launch refills one slot: its host cost, without a wait.
    pulled = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}}, staging_in_graph=True)
    pulled.capture(batch_size, req_to_token=table)
    replays = {
        "paired_hand_replay": lambda i: hand.replay(batches[i % 8], batch_size),
        "paired_replay_copy": lambda i: planner_copy.replay(batches[i % 8], batch_size),
        "paired_replay_in_graph": lambda i: pulled.replay(batches[i % 8], batch_size),
    }
    out.update(time_paired(replays, **kw))
    sync(device)
    out["hand_plan"] = time_host(lambda i: hand.plan(batches[i % 8]), **kw)
    sync(device)
    verify_limits = limits.model_copy(update={"next_n": 2})
    planner = Planner(["nsa"], verify_limits, options={"nsa": {"topk": 2048}})
    planner.capture(batch_size, ForwardMode.TARGET_VERIFY, req_to_token=table)
    verify = [make_verify_batch(b, table) for b in batches]
    out["verify_replay"] = time_host(lambda i, p=planner: p.replay(verify[i % 8], batch_size), **kw)
    sync(device)
    for backend in args.flashinfer:
        try:
            planner = Planner([backend], limits)
        except Exception as exc:  # backend absent or refuses these limits: say so, keep going
            out[f"{backend}_error"] = f"{type(exc).__name__}: {exc}"
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner.capture(batch_size, req_to_token=table)
            # The replay beside the host op's floor, FlashInfer's own plan() of the same host
            # arrays, nothing else, and the compiled scheduler call a graph slot's replay makes
            # instead: interleaved call by call, so the host's drift falls on all alike.
            # Without flashinfer (the CPU) the slot only keeps bookkeeping: no floor to take.
            plan = planner.replay(batches[0], batch_size)[backend]
            slot, indices = plan.wrapper.slot, plan.kv_indices
            variants = {"replay": lambda i, p=planner: p.replay(batches[i % 8], batch_size)}
            if slot.wrapper is not None:
                variants["bare_plan"] = lambda i, s=slot, x=indices: s._plan_wrapper(x)
                if slot.direct is not None:
                    variants["scheduler"] = lambda i, s=slot: s.direct(s.args)
            for name, stats in time_paired(variants, **kw).items():
                out[f"{backend}_{name}"] = stats
            sync(device)
            out[f"{backend}_plan"] = time_host(lambda i, p=planner: p.plan(batches[i % 8]), **kw)
            sync(device)
    return out


def make_verify_batch(batch: ForwardBatch, table: torch.Tensor) -> ForwardBatch:
    """The same requests verifying 2 tokens: their last two positions."""
    seq = batch.seq_lens_cpu
    pool = batch.req_pool_indices.to(table.device).long()
    cols = torch.stack([seq - 2, seq - 1], 1).to(table.device).long()
    loc = table[pool[:, None], cols].reshape(-1).cpu()
    return dataclasses.replace(
        batch,
        out_cache_loc=loc,
        positions=cols.reshape(-1).to(torch.int32).cpu(),
        mode=ForwardMode.TARGET_VERIFY,
        next_n=2,
    )


def extend_setup(context: int, device: torch.device, seed: int) -> tuple[Planner, ForwardBatch]:
    """An NSA planner and one extend batch of a 2048-token chunk: 4 requests of 512 new
    tokens each after ``context - 512`` cached."""
    sms = num_sms_of(device)
    table, num_pages = make_table(4, context, device, seed)
    limits = Limits(
        max_batch=4,
        max_context=context,
        num_sms=sms,
        max_tokens=2048,
        kv_slots=num_pages * 64,
        device=str(device),
    )
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
    lens = torch.tensor([context] * 4, dtype=torch.int32)
    new = torch.full((4,), 512, dtype=torch.int32)
    cols = torch.cat([torch.arange(context - 512, context)] * 4)
    rows = torch.arange(1, 5).repeat_interleave(512)
    loc = table[rows.to(device), cols.to(device)].cpu()
    batch = ForwardBatch(
        seq_lens_cpu=lens,
        req_pool_indices=torch.arange(1, 5, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=loc,
        mode=ForwardMode.EXTEND,
        extend_lens_cpu=new,
    )
    return planner, batch


def measure_extend(args, device: torch.device) -> dict[str, Any]:
    """One eager extend plan of a 2048-token chunk (``extend_setup``)."""
    planner, batch = extend_setup(args.context, device, args.seed)
    out = time_host(lambda i: planner.plan(batch), warmup=args.warmup, iters=args.iters)
    sync(device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="planner host overhead vs hand-written metadata code")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--flashinfer", nargs="*", default=["flashinfer_decode", "flashinfer_mla"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    results = [
        dict(run=run, **measure(args, bs, device))
        for run in range(args.runs)
        for bs in args.batches
    ]
    extend = [measure_extend(args, device) for _ in range(args.runs)]
    cols = [
        "plan",
        "plan_numpy_twins",
        "plan_torch_ops",
        "replay_ops_in_graph",
        "replay_ops_outside",
        "verify_replay",
        "hand_replay",
        "hand_plan",
        "paired_hand_replay",
        "paired_replay_copy",
        "paired_replay_in_graph",
    ]
    replays_paired = ("paired_replay_copy", "paired_replay_in_graph")
    fi_cols = [
        f"{b}_{k}" for b in args.flashinfer for k in ("plan", "replay", "bare_plan", "scheduler")
    ]
    cols += [c for c in fi_cols if any(c in r for r in results)]
    rows = [
        (r["run"], r["batch"], *(r[c]["median_us"] if c in r else "-" for c in cols))
        for r in results
    ]
    table = print_table(
        "planner host time per step, median us (no device sync)", ("run", "batch", *cols), rows
    )
    table += "\n" + print_table(
        "the same, p99 us",
        ("run", "batch", *cols),
        [
            (r["run"], r["batch"], *(r[c]["p99_us"] if c in r else "-" for c in cols))
            for r in results
        ],
    )
    paired = ("plan_numpy_twins",)
    table += "\n" + print_table(
        "replays interleaved with the hand-written one: median of per-call ratios to it "
        "(the target is <= 0.2)",
        ("run", "batch", "paired_replay_copy", "paired_replay_in_graph"),
        [
            (r["run"], r["batch"], *(r[c]["ratio_to_first"] for c in replays_paired))
            for r in results
        ],
    )
    table += "\n" + print_table(
        "interleaved: median of per-call ratios to plan() as shipped",
        ("run", "batch", *paired),
        [(r["run"], r["batch"], *(r[c]["ratio_to_first"] for c in paired)) for r in results],
    )
    fi_pairs = [f"{b}_bare_plan" for b in args.flashinfer]
    fi_pairs = [c for c in fi_pairs if any(c in r for r in results)]
    if fi_pairs:
        table += "\n" + print_table(
            "FlashInfer, interleaved: replay over the bare plan() (median of per-call ratios; "
            "the target is <= 1.1)",
            ("run", "batch", *fi_pairs),
            [
                (
                    r["run"],
                    r["batch"],
                    *(1 / r[c]["ratio_to_first"] if c in r else "-" for c in fi_pairs),
                )
                for r in results
            ],
        )
    table += "\n" + print_table(
        f"eager extend plan, 2048 tokens (4 x 512 new, {max(args.context - 512, 0)} cached each)",
        ("run", "median us", "p99 us"),
        [(run, e["median_us"], e["p99_us"]) for run, e in enumerate(extend)],
    )
    for r in results:
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"batch {r['batch']}: {k}: {v}")
    write_json(
        args.out,
        {
            "machine": machine(),
            "args": vars(args),
            "results": results,
            "extend": extend,
            "table": table,
        },
    )
    first = [r for r in results if r["run"] == 0]
    plot_bars(
        args.plot,
        "planner host time per step",
        [f"B{r['batch']}" for r in first],
        {c: [r[c]["median_us"] if c in r else 0.0 for r in first] for c in cols},
        "us (median)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
