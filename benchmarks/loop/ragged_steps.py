"""Mixed steps replayed from ragged graphs against the same batches run eagerly.

Issue 37's measurement: ``D`` requests decoding at ``--context`` tokens of KV plus one
prompt chunk of ``C`` tokens, as one mixed batch, for D in ``--decoding`` and C in
``--chunks`` (after ``--prefix`` cached tokens of its prompt). Each batch runs through the engine's graph runner twice, side by side in
one process: replayed from the token bucket that holds it, and eagerly (the same runner,
``eager=``: fresh plans, the forward without a graph). Reported per batch: step time
(median and p99 over ``--iters`` after ``--warmup``), their ratio, and the planner's host
time per ragged replay (the runner's refresh: ``planner.replay``); with ``--profile N``,
the device time of N steps of each, kernel group by kernel group, side by side; with
``--host-profile N``, where the replayed step's host time goes (cProfile of N steps, each
synchronised as timed) and ``planner.replay`` alone in a tight loop, to tell its own work
from what a step between replays costs it (caches and clocks after a device wait). The KV
each request reads is its own range of cache slots (rows of the token table), so
attention reads as much memory as a real step; what it reads is whatever the cache holds.

    python3 -m benchmarks ragged_steps --config dsv32-shapes --out "$OUT/ragged.json" \
        --plot "$OUT/ragged.png"                    # the H200
    python3 -m benchmarks ragged_steps --smoke      # the CPU: the tiny model, a few steps
"""

from __future__ import annotations

import argparse
import cProfile
import sys
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.common import (
    cprofile_rows,
    cprofile_top,
    logits_of,
    plot_bars,
    print_table,
    sync,
    time_calls,
    time_host,
    write_json,
)
from benchmarks.kernels.profile_step import print_side_by_side, profile_steps
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from graphs.sizes import default_token_ladder
from planner.batch import ForwardBatch, ForwardMode

GPU_STEPS = {
    "": "--config dsv32-shapes --out {out}/ragged.json --plot {out}/ragged.png",
}


def mixed_batch(engine: DecodeEngine, decoding: int, context: int, chunk: int, prefix: int = 0):
    """``decoding`` one-token extends at ``context`` KV and one ``chunk``-token prompt
    chunk after ``prefix`` cached tokens of its prompt."""
    table = engine.pool.req_to_token
    slots = engine.cache.num_slots
    width = table.shape[1]
    lens, new, rows = [context] * decoding + [prefix + chunk], [1] * decoding + [chunk], []
    locs, positions = [], []
    for r, (length, n) in enumerate(zip(lens, new)):
        row = r + 1  # row 0 is the null request
        base = (row * width) % max(slots - width, 1) + 1
        table[row, :length] = torch.arange(base, base + length, dtype=table.dtype)
        rows.append(row)
        positions += range(length - n, length)
        locs += table[row, length - n : length].tolist()
    batch = ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(rows, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int32),
        mode=ForwardMode.MIXED,
        extend_lens_cpu=torch.tensor(new, dtype=torch.int32),
    )
    ids = torch.ones(sum(new), dtype=torch.int64, device=table.device)
    return batch, ids


def routed_buckets(decoding: list[int], chunks: list[int], max_batch: int) -> list[int]:
    """The buckets of the default token ladder that the measured batches route to.

    Only these are captured (and one decode size): the batches pad exactly as they would in
    a server with the full ladder, while the device call skips the graphs no batch replays
    (on dsv32-shapes, 3 token buckets of 8, and 1 decode size of 13). The whole ladder's
    capture time and memory are reported by the serving runs (``planner decode``)."""
    # A step's token budget (DecodeEngine's Limits.max_tokens, loop.chunk_tokens) holds the
    # largest chunk and a decode row per request.
    ladder = default_token_ladder(max(chunks) + max_batch, max_batch)
    return sorted({min(s for s in ladder if s >= d + c) for d in decoding for c in chunks})


def measure(args: argparse.Namespace) -> dict[str, Any]:
    top = max(max(args.decoding) + 1, 2)
    overrides = {
        "loop.mixed": True,
        "graphs.ragged": True,
        "graphs.sizes": [1],
        "graphs.token_sizes": routed_buckets(args.decoding, args.chunks, top),
        "loop.chunk_tokens": max(args.chunks) + top,  # the budget holds decode rows too
        "planner.max_batch": top,
        "planner.ragged_kv_tokens": top * args.context + args.prefix + max(args.chunks),
    }
    engine = DecodeEngine(load_run_config(args.config, overrides), keep_logits=True)
    capture = engine.runner.capture().summary()
    timing = {"warmup": args.warmup, "iters": args.iters}
    rows = []
    for decoding in args.decoding:
        for chunk in args.chunks:
            batch, ids = mixed_batch(engine, decoding, args.context, chunk, args.prefix)
            size, why = engine.runner.route(
                ForwardMode.MIXED, batch.bs, batch.num_tokens, int(batch.seq_lens_cpu.sum())
            )
            inputs = {"input_ids": ids}
            stats = engine.runner.stats
            refresh0, replays0 = stats.ragged_refresh_seconds, stats.ragged_replays
            graph = time_calls(
                lambda _, b=batch, x=inputs: engine.runner.step(b, x), engine.device, **timing
            )
            host = (stats.ragged_refresh_seconds - refresh0) / max(
                stats.ragged_replays - replays0, 1
            )
            eager = time_calls(
                lambda _, b=batch, x=inputs: engine.runner.step(b, x, eager="benchmark"),
                engine.device,
                **timing,
            )
            profiled = {}
            if args.profile:
                profiled = {
                    variant: _profile(engine, batch, inputs, args.profile, eager)
                    for variant, eager in (("graph", None), ("eager", "benchmark"))
                }
                print_side_by_side(f"kernels of {decoding} decoding + {chunk} chunk", profiled)
            hosted = _host_profile(engine, batch, inputs, args.host_profile)
            row = {
                **_agreement(engine, batch, inputs),
                "decoding": decoding,
                "chunk": chunk,
                "tokens": batch.num_tokens,
                "bucket": size,
                "fallback": why,
                "graph": graph,
                "eager": eager,
                "planner_host_us_per_ragged_replay": host * 1e6,
                "speedup_median": eager["median_ms"] / graph["median_ms"],
                "profile": profiled,
                "host_profile": hosted,
            }
            rows.append(row)
    return {
        "config": args.config,
        "device": str(engine.device),
        "context": args.context,
        "prefix": args.prefix,
        "capture": capture,
        "rows": rows,
    }


def _profile(engine: DecodeEngine, batch: ForwardBatch, inputs, steps: int, eager) -> dict:
    """Device time of the batch's step (replayed, or eager), by kernel group."""
    step = lambda _: engine.runner.step(batch, inputs, eager=eager)  # noqa: E731
    return profile_steps(step, steps, engine.device, top=12)[0]


def _host_profile(engine: DecodeEngine, batch: ForwardBatch, inputs, steps: int) -> dict:
    """Where a replayed step's planner time goes: ``planner.replay`` profiled (cProfile, top
    functions by self time) inside ``steps`` synchronised steps, and again back to back
    alone, with the median of each unprofiled: the same calls, warm or after a step."""
    if not steps:
        return {}
    runner, planner = engine.runner, engine.runner.planner
    runner.step(batch, inputs)
    plans = runner.last_plans  # the bucket the step replayed
    replay = planner.replay

    def alone(_: int) -> None:
        replay(batch, plans.reqs, tokens=plans.tokens)

    out = {"alone": time_host(alone, warmup=20, iters=max(steps, 100))}
    out["alone_top"] = cprofile_top(alone, max(steps, 100), top=15)
    sync(engine.device)
    prof = cProfile.Profile()

    def profiled(*args, **kwargs):
        prof.enable()
        try:
            return replay(*args, **kwargs)
        finally:
            prof.disable()

    planner.replay = profiled  # this benchmark's own instance: the runner's call goes through
    try:
        for _ in range(steps):
            runner.step(batch, inputs)
            sync(engine.device)
    finally:
        del planner.replay
    out["in_steps_top"] = cprofile_rows(prof, steps, top=15)
    print(
        f"host: planner.replay alone p50 {out['alone']['median_us']:.1f} us, p99 "
        f"{out['alone']['p99_us']:.1f} us; profiled (self us per call, alone | in steps):"
    )
    for name in ("alone_top", "in_steps_top"):
        for row in out[name]:
            print(
                f"  {name[:-4]:8s} {row['self_us']:8.1f} {row['total_us']:8.1f} "
                f"{row['calls_per_iter']:6.1f}  {row['function']}"
            )
    return out


def _agreement(engine: DecodeEngine, batch: ForwardBatch, inputs) -> dict[str, Any]:
    """The replayed step's logits beside the eager step's, on the real rows. In bf16 they
    need not be bit-equal (the padded bucket's GEMMs tile another M), so the largest
    difference and whether every row picks the same token are reported."""
    graph = logits_of(engine.runner.step(batch, inputs)).float().clone()
    eager = logits_of(engine.runner.step(batch, inputs, eager="benchmark")).float()
    return {
        "max_abs_diff": float((graph - eager).abs().max()),
        "same_argmax": bool(torch.equal(graph.argmax(-1), eager.argmax(-1))),
    }


def table(result: dict[str, Any]) -> str:
    return print_table(
        f"mixed steps, {result['config']} on {result['device']}, context {result['context']}, "
        f"chunk prefix {result['prefix']}",
        ("decoding", "chunk", "bucket", "graph ms p50", "p99", "eager ms p50", "p99",
         "speed-up", "host us/replay", "max |g-e|", "argmax"),
        [
            (r["decoding"], r["chunk"], r["bucket"], r["graph"]["median_ms"], r["graph"]["p99_ms"],
             r["eager"]["median_ms"], r["eager"]["p99_ms"], r["speedup_median"],
             r["planner_host_us_per_ragged_replay"], r["max_abs_diff"],
             "same" if r["same_argmax"] else "DIFFER")
            for r in result["rows"]
        ],
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv32-shapes", help="a shipped config or a YAML file")
    p.add_argument("--decoding", type=int, nargs="+", default=[16, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--context", type=int, default=2048, help="KV tokens of each decoding request")
    p.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="cached tokens before the chunk (0: a fresh prompt; past --context every "
        "chunk token reads a full top-k, as decoding requests do)",
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also profile STEPS steps of each batch, replayed and eager: kernels by group",
    )
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also cProfile STEPS replayed steps of each batch and time planner.replay alone",
    )
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--smoke", action="store_true", help="the CPU tiny model, a few steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.decoding, args.chunks = "dsv32-tiny", [2, 4], [8, 32]
        args.context, args.iters, args.warmup = 64, 3, 1
        args.host_profile = min(args.host_profile, 3)
    result = measure(args)
    table(result)
    write_json(args.out, result)
    rows = result["rows"]
    plot_bars(
        args.plot,
        f"mixed steps: ragged graph vs eager ({result['config']})",
        [f"{r['decoding']}+{r['chunk']}" for r in rows],
        {v: [r[v]["median_ms"] for r in rows] for v in ("graph", "eager")},
        "step median (ms)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
