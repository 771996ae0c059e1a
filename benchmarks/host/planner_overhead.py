#!/usr/bin/env python3
"""Host time the planner adds per step, beside metadata code written the way engines write it.

For each batch size, host time (no device sync) of
  - eager ``plan()`` interleaved call by call with the hand-written eager path (``HandWrittenNSA
    .plan``: one tensor op or copy per field, into fresh tensors), for one set of batches
    planned again and for a decode whose lengths grow a token a call (what a serving loop
    with graphs off plans: a new shape every step);
  - ``replay()``, staged by the copy and by the graph's own pull, interleaved with the
    hand-written replay (``HandWrittenNSA.replay``: per-field copies into static buffers);
  - a target-verify replay (``next_n`` 2), and an eager extend plan of one 2048-token chunk;
  - FlashInfer's backends where they are usable: the replay beside the bare FlashInfer
    ``plan()`` of the same batch, interleaved.
Medians and p99 of ``--iters`` calls after ``--warmup``; ratios are medians of per-call
ratios (the host's speed drifts between blocks of calls, not within one round).

Only the public API is used, so the same script measures an older commit's tree beside this
one in one device call (``scripts/gpu_old_new.sh``).

    python3 -m benchmarks planner_overhead --out $OUT/planner_overhead.json --plot $OUT/po.png
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import warnings
from typing import Any

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
from benchmarks.kernels.seed_stack import batch_of, make_batch, make_table
from planner import ForwardBatch, ForwardMode, Limits, Planner

GPU_STEPS = {
    "": "--iters 300 --out {out}/planner_overhead.json --plot {out}/planner_overhead.png",
}

try:  # this tree: the graph pulls through a transport; older trees took a flag
    from graphs import PulledTransport

    PULLED: dict[str, Any] = {"transport": PulledTransport}
except ImportError:  # pragma: no cover - an older commit's tree
    PULLED = {"staging_in_graph": True}


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

    def replay(self, batch: ForwardBatch, bs: int) -> None:
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

    def plan(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
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


def growing(table: torch.Tensor, bs: int, context: int, calls: int, rng: random.Random) -> list:
    """``calls`` decode batches of ``bs`` requests whose lengths grow by one token a call."""
    start = [rng.randint(context // 2, context - calls - 1) for _ in range(bs)]
    return [batch_of(table, [n + i for n in start]) for i in range(calls)]


def _walk(fn, batches: list):
    return lambda i: fn(batches[i % len(batches)])


def measure(args, batch_size: int, device: torch.device) -> dict[str, Any]:
    sms = num_sms_of(device)
    table, num_pages = make_table(batch_size, args.context, device, args.seed)
    rng = random.Random(args.seed)
    batches = [make_batch(table, batch_size, args.context, rng) for _ in range(8)]
    grown = growing(table, batch_size, args.context, args.iters + args.warmup, rng)
    limits = Limits(
        max_batch=batch_size,
        max_context=args.context,
        page_size=64,
        num_sms=sms,
        kv_slots=num_pages * 64,
        device=str(device),
    )
    options = {"nsa": {"topk": 2048}}
    kw = dict(warmup=args.warmup, iters=args.iters)
    hand = HandWrittenNSA(batch_size, args.context, device, sms, 2048)
    eager = Planner(["nsa"], limits, options=options)
    copied = Planner(["nsa"], limits, options=options)
    copied.capture(batch_size, req_to_token=table)
    pulled = Planner(["nsa"], limits, options=options, **PULLED)
    pulled.capture(batch_size, req_to_token=table)
    out: dict[str, Any] = {"batch": batch_size}
    out["eager"] = time_paired(
        {"plan": _walk(eager.plan, batches), "hand_plan": _walk(hand.plan, batches)}, **kw
    )
    sync(device)
    out["growing"] = time_paired(
        {"plan": _walk(eager.plan, grown), "hand_plan": _walk(hand.plan, grown)}, **kw
    )
    sync(device)
    # a replay staged for the pull without its graph's launch refills one slot: its host
    # cost, with no wait on a pull that never comes
    out["replay"] = time_paired(
        {
            "hand_replay": lambda i: hand.replay(batches[i % 8], batch_size),
            "replay_copy": lambda i: copied.replay(batches[i % 8], batch_size),
            "replay_pulled": lambda i: pulled.replay(batches[i % 8], batch_size),
        },
        **kw,
    )
    sync(device)
    verify = Planner(["nsa"], limits.model_copy(update={"next_n": 2}), options=options)
    verify.capture(batch_size, ForwardMode.TARGET_VERIFY, req_to_token=table)
    verifying = [make_verify_batch(b, table) for b in batches]
    out["verify_replay"] = time_host(lambda i: verify.replay(verifying[i % 8], batch_size), **kw)
    sync(device)
    for backend in args.flashinfer:
        out.update(measure_flashinfer(backend, limits, table, batches, batch_size, kw, device))
    return out


def measure_flashinfer(backend, limits, table, batches, batch_size, kw, device) -> dict:
    """The backend's replay beside the bare FlashInfer ``plan()`` of the same host arrays,
    interleaved; nothing where the backend or flashinfer is not usable here."""
    try:
        planner = Planner([backend], limits)
    except Exception as exc:  # backend absent or refuses these limits: say so, keep going
        return {f"{backend}_error": f"{type(exc).__name__}: {exc}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.capture(batch_size, req_to_token=table)
        plan = planner.replay(batches[0], batch_size)[backend]
        slot, indices = plan.wrapper.slot, plan.kv_indices
        variants = {"replay": lambda i: planner.replay(batches[i % 8], batch_size)}
        if getattr(slot, "wrapper", None) is not None:
            variants["bare_plan"] = lambda i: slot._plan_wrapper(indices)
        out = {f"{backend}_{name}": s for name, s in time_paired(variants, **kw).items()}
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
    table, num_pages = make_table(4, context, device, seed)
    limits = Limits(
        max_batch=4,
        max_context=context,
        num_sms=num_sms_of(device),
        max_tokens=2048,
        kv_slots=num_pages * 64,
        device=str(device),
    )
    planner = Planner(["nsa"], limits, options={"nsa": {"topk": 2048}})
    cols = torch.cat([torch.arange(context - 512, context)] * 4)
    rows = torch.arange(1, 5).repeat_interleave(512)
    batch = ForwardBatch(
        seq_lens_cpu=torch.tensor([context] * 4, dtype=torch.int32),
        req_pool_indices=torch.arange(1, 5, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=table[rows.to(device), cols.to(device)].cpu(),
        mode=ForwardMode.EXTEND,
        extend_lens_cpu=torch.full((4,), 512, dtype=torch.int32),
    )
    return planner, batch


ROWS = (
    ("eager", "plan"),
    ("eager", "hand_plan"),
    ("growing", "plan"),
    ("growing", "hand_plan"),
    ("replay", "replay_copy"),
    ("replay", "replay_pulled"),
    ("replay", "hand_replay"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="planner host overhead vs hand-written metadata code")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--flashinfer", nargs="*", default=["flashinfer_decode", "flashinfer_mla"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = [measure(args, bs, device) for bs in args.batches]
    planner, batch = extend_setup(args.context, device, args.seed)
    extend = time_host(lambda i: planner.plan(batch), warmup=args.warmup, iters=args.iters)
    sync(device)
    head = ("batch", *(f"{group} {name}" for group, name in ROWS), "verify replay")
    table = print_table(
        "planner host time per call, median us (p99), no device sync",
        head,
        [
            (
                r["batch"],
                *(f"{r[g][n]['median_us']:.1f} ({r[g][n]['p99_us']:.0f})" for g, n in ROWS),
                f"{r['verify_replay']['median_us']:.1f}",
            )
            for r in results
        ],
    )
    table += "\n" + print_table(
        "interleaved: median of per-call ratios",
        ("batch", "plan / hand", "growing plan / hand", "replay copy / hand", "pulled / hand"),
        [
            (
                r["batch"],
                f"{1 / r['eager']['hand_plan']['ratio_to_first']:.3f}",
                f"{1 / r['growing']['hand_plan']['ratio_to_first']:.3f}",
                f"{r['replay']['replay_copy']['ratio_to_first']:.3f}",
                f"{r['replay']['replay_pulled']['ratio_to_first']:.3f}",
            )
            for r in results
        ],
    )
    fi = [(b, f"{b}_replay", f"{b}_bare_plan") for b in args.flashinfer]
    fi = [f for f in fi if any(f[2] in r for r in results)]
    if fi:
        table += "\n" + print_table(
            "FlashInfer: replay over the bare plan() (median of per-call ratios), median us",
            ("batch", *(f"{b} ratio / replay / bare" for b, _, _ in fi)),
            [
                (
                    r["batch"],
                    *(
                        f"{1 / r[bare]['ratio_to_first']:.3f} / {r[rep]['median_us']:.1f} / "
                        f"{r[bare]['median_us']:.1f}"
                        for _, rep, bare in fi
                    ),
                )
                for r in results
            ],
        )
    table += "\n" + print_table(
        f"eager extend plan, 2048 tokens (4 x 512 new, {max(args.context - 512, 0)} cached each)",
        ("median us", "p99 us"),
        [(f"{extend['median_us']:.1f}", f"{extend['p99_us']:.1f}")],
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
    plot_bars(
        args.plot,
        "planner host time per call",
        [f"B{r['batch']}" for r in results],
        {f"{g} {n}": [r[g][n]["median_us"] for r in results] for g, n in ROWS},
        "us (median)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
