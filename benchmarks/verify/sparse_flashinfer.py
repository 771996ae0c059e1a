#!/usr/bin/env python3
"""FlashInfer's sparse MLA through the planner: correctness over random batches, then speed.

Three parts, on the real DeepSeek-V3.2 attention shape (128 heads, 512 latent + 64 rope,
top-k 2048, bf16), over plans made by ``Planner(["nsa", "nsa_flashinfer"])``:

1. **Correctness** over ``--batches`` random batches (random sizes up to 128, random
   lengths, so rows shorter and longer than top-k): each batch is replayed at the
   smallest captured size, and ``sparse_mla_flashinfer`` over indexer-like slots
   (``kv_len[r]`` distinct valid slots, ``-1`` after) is compared with the exact
   reference ``sparse_mla_decode`` in fp32 (relative Frobenius error, and the worst
   element relative to the reference's largest).
2. **Under CUDA graphs**: per size, the layer (slot write + ``run``) captured once,
   replayed over new slots and new lengths; replay must equal the eager call bit for bit.
3. **Speed**, at full lengths: the captured layer with FlashInfer against the NSA plan's
   Triton kernel; and the host side, ``replay()`` with the plan memo hit (lengths
   unchanged) against lengths that change every step (FlashInfer's ``plan()`` runs).

    python3 -m benchmarks sparse_flashinfer --out $OUT/sparse_flashinfer.json
"""

from __future__ import annotations

import argparse
import math
import random
import warnings

import torch

from backends.nsa.attention import sparse_mla, sparse_mla_decode
from backends.nsa_flashinfer import sparse_mla_flashinfer
from benchmarks.common import machine, plot_bars, print_table, time_graph, time_host, write_json
from benchmarks.kernels.seed_stack import batch_of, make_table
from planner import ForwardBatch, ForwardMode, Limits, Planner

GPU_STEPS = {
    "": "--out {out}/sparse_flashinfer.json --plot {out}/sparse_flashinfer.png",
}

HEADS, LATENT, ROPE, TOPK = 128, 512, 64, 2048
SCALE = 1.0 / math.sqrt(192)
TOLERANCE = 2e-2
"""Relative Frobenius error allowed against the fp32 reference (bf16 inputs and output:
the output's own rounding is ~1.7e-3 of it; typical is ~2e-3)."""


def make_planner(
    sizes: list[int], ctx: int, slots: int, device: torch.device, backends=("nsa", "nsa_flashinfer")
) -> Planner:
    limits = Limits(
        max_batch=max(sizes),
        max_context=ctx,
        page_size=64,
        num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
        kv_slots=slots,
        device=str(device),
    )
    options = {
        "nsa": {"topk": TOPK, "mla_heads": HEADS, "mla_kernel": "triton"},
        "nsa_flashinfer": {"sparse_topk": TOPK, "sparse_heads": HEADS, "sparse_sm_scale": SCALE},
    }
    return Planner(list(backends), limits, options={b: options[b] for b in backends})


def indexer_like_slots(kv_len: torch.Tensor, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``kv_len[r]`` distinct valid slots per row, ``-1`` after: what the top-k hands a layer."""
    rows = kv_len.shape[0]
    perm = torch.randperm(num_slots - 1, generator=gen, device=kv_len.device)[: rows * TOPK] + 1
    slots = perm.view(rows, TOPK).to(torch.int32)
    past = torch.arange(TOPK, device=kv_len.device) >= kv_len.unsqueeze(1)
    return slots.masked_fill(past, -1)


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = got.float() - ref
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / ref.abs().max().clamp_min(1e-30))
    return rel, worst


def replay(planner: Planner, batch: ForwardBatch, sizes: list[int]):
    bs = min(s for s in sizes if s >= batch.bs)
    plans = planner.replay(batch, bs)
    planner.record(bs, ForwardMode.DECODE)
    return bs, plans


def correctness(planner, table, kv, sizes, ctx, args, gen, rng) -> dict:
    worst_rel, worst_elem, shorter = 0.0, 0.0, 0
    for i in range(args.batches):
        n = rng.randint(1, max(sizes))
        lens = [rng.randint(1, ctx) for _ in range(n)]
        _, plans = replay(planner, batch_of(table, lens), sizes)
        fi = plans["nsa_flashinfer"]
        rows = fi.kv_len.shape[0]
        q = torch.randn(rows, HEADS, LATENT, device=kv.device, generator=gen).to(kv.dtype)
        qr = torch.randn(rows, HEADS, ROPE, device=kv.device, generator=gen).to(kv.dtype)
        slots = indexer_like_slots(fi.kv_len, kv.shape[0], gen)
        got = sparse_mla_flashinfer(fi, q, qr, kv, slots, SCALE)
        ref = sparse_mla_decode(q.float(), qr.float(), kv, slots, SCALE)
        real = len(lens)  # padding rows are not compared: nobody reads them
        rel, elem = errors(got[:real], ref[:real])
        worst_rel, worst_elem = max(worst_rel, rel), max(worst_elem, elem)
        shorter += sum(1 for n in lens if n < TOPK)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1} batches, worst rel err {worst_rel:.3e}", flush=True)
    return {
        "batches": args.batches,
        "rows_shorter_than_topk": shorter,
        "max_rel_err": worst_rel,
        "max_elem_err_rel_to_max": worst_elem,
        "tolerance": TOLERANCE,
        "ok": worst_rel <= TOLERANCE,
    }


def graphs(planner, table, kv, sizes, ctx, gen, rng) -> dict:
    """Capture the layer per size; replays over new slots and lengths equal eager calls."""
    out = {}
    for bs in sizes:
        lens = [ctx] * bs
        _, plans = replay(planner, batch_of(table, lens), sizes)
        fi = plans["nsa_flashinfer"]
        q = torch.randn(bs, HEADS, LATENT, device=kv.device, generator=gen).to(kv.dtype)
        qr = torch.randn(bs, HEADS, ROPE, device=kv.device, generator=gen).to(kv.dtype)
        slots = indexer_like_slots(fi.kv_len, kv.shape[0], gen)
        result = torch.empty_like(q)

        def layer(fi=fi, q=q, qr=qr, slots=slots, result=result):
            result.copy_(sparse_mla_flashinfer(fi, q, qr, kv, slots, SCALE))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer()
        equal = True
        for _ in range(4):
            lens = [rng.randint(1, ctx) for _ in range(bs)]
            replay(planner, batch_of(table, lens), [bs])
            slots.copy_(indexer_like_slots(fi.kv_len, kv.shape[0], gen))
            graph.replay()
            torch.cuda.synchronize()
            replayed = result.clone()
            layer()
            equal &= torch.equal(replayed, result)
        out[bs] = equal
        del graph
    return {"replay_equals_eager": out, "ok": all(out.values())}


def speed_of(planner, nsa_only, table, kv, bs: int, sizes, ctx, gen, args) -> dict:
    """One size: the captured layer on both kernels, and ``replay()`` with and without a
    FlashInfer ``plan()``, beside the NSA plan alone (``nsa_only``) on the same batch."""
    lens = [ctx] * bs
    _, plans = replay(planner, batch_of(table, lens), sizes)
    fi, nsa = plans["nsa_flashinfer"], plans["nsa"]
    q = torch.randn(bs, HEADS, LATENT, device=kv.device, generator=gen).to(kv.dtype)
    qr = torch.randn(bs, HEADS, ROPE, device=kv.device, generator=gen).to(kv.dtype)
    slots = indexer_like_slots(fi.kv_len, kv.shape[0], gen)
    flash = time_graph(
        lambda: sparse_mla_flashinfer(fi, q, qr, kv, slots, SCALE), warmup=5, iters=args.iters
    )
    triton = time_graph(
        lambda: sparse_mla(nsa, q, qr, kv, slots, SCALE), warmup=5, iters=args.iters
    )
    same = batch_of(table, lens)
    moving = [batch_of(table, [TOPK - 1 - (i % 7)] * bs) for i in range(8)]  # a plan each
    slot = fi.wrapper.slot
    before = slot.plans
    hit = time_host(lambda i: planner.replay(same, bs), warmup=5, iters=args.host_iters)
    replanned = slot.plans - before
    miss = time_host(lambda i: planner.replay(moving[i % 8], bs), warmup=5, iters=args.host_iters)
    alone = time_host(lambda i: nsa_only.replay(same, bs), warmup=5, iters=args.host_iters)
    print(
        f"bs {bs}: FlashInfer {flash['median_us']:.1f} us, Triton {triton['median_us']:.1f} us;"
        f" replay() {hit['median_us']:.1f} us memo hit, {miss['median_us']:.1f} us re-planned,"
        f" {alone['median_us']:.1f} us NSA alone",
        flush=True,
    )
    return {
        "bs": bs,
        "flashinfer_us": flash,
        "triton_us": triton,
        "replay_memo_hit_us": hit,
        "replay_replanned_us": miss,
        "replay_nsa_alone_us": alone,
        "plans_during_memo_hits": replanned,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="FlashInfer sparse MLA via the planner: check, time")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--ctx", type=int, default=4096, help="longest context (>= 2048: some rows fit)")
    p.add_argument("--batches", type=int, default=200, help="random batches checked")
    p.add_argument("--iters", type=int, default=100, help="graph replays timed per variant")
    p.add_argument("--host-iters", type=int, default=300, help="replay() calls timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG of the kernel times")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA and flashinfer (the CPU suite covers the plumbing)")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rng = random.Random(args.seed)
    table, num_pages = make_table(max(args.sizes), args.ctx, device, args.seed)
    slots = num_pages * 64
    kv = (torch.randn(slots, LATENT + ROPE, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    planner = make_planner(args.sizes, args.ctx, slots, device)
    nsa_only = make_planner(args.sizes, args.ctx, slots, device, backends=("nsa",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for bs in args.sizes:
            planner.capture(bs, req_to_token=table)
            nsa_only.capture(bs, req_to_token=table)
        result = {
            "correctness": correctness(planner, table, kv, args.sizes, args.ctx, args, gen, rng),
            "graphs": graphs(planner, table, kv, args.sizes, args.ctx, gen, rng),
            "speed": [
                speed_of(planner, nsa_only, table, kv, bs, args.sizes, args.ctx, gen, args)
                for bs in args.sizes
            ],
        }
    c = result["correctness"]
    print(
        f"correctness: {c['batches']} batches, max rel err {c['max_rel_err']:.3e} "
        f"(tolerance {TOLERANCE}), worst element {c['max_elem_err_rel_to_max']:.3e}; "
        f"graphs: replay equals eager {result['graphs']['replay_equals_eager']}"
    )
    table_rows = [
        (
            r["bs"],
            r["flashinfer_us"]["median_us"],
            r["flashinfer_us"]["p99_us"],
            r["triton_us"]["median_us"],
            r["triton_us"]["median_us"] / r["flashinfer_us"]["median_us"],
            r["replay_memo_hit_us"]["median_us"],
            r["replay_replanned_us"]["median_us"],
            r["replay_nsa_alone_us"]["median_us"],
        )
        for r in result["speed"]
    ]
    text = print_table(
        f"sparse MLA per layer, ctx {args.ctx}, full top-k (graph replays, us)",
        (
            "bs",
            "FlashInfer",
            "p99",
            "Triton",
            "Triton/FI",
            "replay() memo",
            "+ plan()",
            "NSA alone",
        ),
        table_rows,
    )
    plot_bars(
        args.plot,
        "sparse MLA per layer (us)",
        [f"bs {r['bs']}" for r in result["speed"]],
        {
            "FlashInfer": [r["flashinfer_us"]["median_us"] for r in result["speed"]],
            "Triton": [r["triton_us"]["median_us"] for r in result["speed"]],
        },
        "us per layer",
    )
    write_json(args.out, {"machine": machine(), "args": vars(args), **result, "table": text})
    return 0 if c["ok"] and result["graphs"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
