"""Mixed steps replayed from ragged graphs against the same batches run eagerly.

Issue 37's measurement: ``D`` requests decoding at ``--context`` tokens of KV plus one
prompt chunk of ``C`` tokens, as one mixed batch, for D in ``--decoding`` and C in
``--chunks``. Each batch runs through the engine's graph runner twice, side by side in
one process: replayed from the token bucket that holds it, and eagerly (the same runner,
``eager=``: fresh plans, the forward without a graph). Reported per batch: step time
(median and p99 over ``--iters`` after ``--warmup``), their ratio, and the planner's host
time per ragged replay (the runner's refresh: ``planner.replay``). The KV each request
reads is its own range of cache slots (rows of the token table), so attention reads as
much memory as a real step; what it reads is whatever the cache holds.

    python3 -m benchmarks.ragged_steps --config dsv32-shapes --out "$OUT/ragged.json" \
        --plot "$OUT/ragged.png"                    # the H200
    python3 -m benchmarks.ragged_steps --smoke      # the CPU: the tiny model, a few steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config
from planner.batch import ForwardBatch, ForwardMode


def mixed_batch(engine: DecodeEngine, decoding: int, context: int, chunk: int):
    """``decoding`` one-token extends at ``context`` KV and one ``chunk``-token prompt."""
    table = engine.pool.req_to_token
    slots = engine.cache.num_slots
    width = table.shape[1]
    lens, new, rows = [context] * decoding + [chunk], [1] * decoding + [chunk], []
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


def _times(engine: DecodeEngine, batch, ids, iters: int, warmup: int, eager: bool) -> list[float]:
    runner, cuda = engine.runner, engine.device.type == "cuda"
    out = []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize(engine.device)
        start = time.perf_counter()
        runner.step(batch, {"input_ids": ids}, eager="benchmark" if eager else None)
        if cuda:
            torch.cuda.synchronize(engine.device)
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    top = max(args.decoding) + 1
    overrides = {
        "loop.mixed": True,
        "graphs.ragged": True,
        "loop.chunk_tokens": max(args.chunks),
        "planner.max_batch": max(top, 2),
        "planner.ragged_kv_tokens": top * args.context + max(args.chunks),
    }
    engine = DecodeEngine(load_run_config(args.config, overrides))
    t0 = time.perf_counter()
    stats = engine.runner.capture()
    capture = {"seconds": time.perf_counter() - t0, **stats.summary()}
    rows = []
    for decoding in args.decoding:
        for chunk in args.chunks:
            batch, ids = mixed_batch(engine, decoding, args.context, chunk)
            size, why = engine.runner.route(
                ForwardMode.MIXED, batch.bs, batch.num_tokens, int(batch.seq_lens_cpu.sum())
            )
            refresh0 = engine.runner.stats.host_seconds["refresh"]
            replays0 = engine.runner.stats.graph_steps
            graph = _times(engine, batch, ids, args.iters, args.warmup, eager=False)
            n = engine.runner.stats.graph_steps - replays0
            host = (engine.runner.stats.host_seconds["refresh"] - refresh0) / max(n, 1)
            eager = _times(engine, batch, ids, args.iters, args.warmup, eager=True)
            row = {
                "decoding": decoding,
                "chunk": chunk,
                "tokens": batch.num_tokens,
                "bucket": size,
                "fallback": why,
                "graph": _stats(graph),
                "eager": _stats(eager),
                "planner_host_us_per_ragged_replay": host * 1e6,
            }
            row["speedup_p50"] = row["eager"]["p50_ms"] / row["graph"]["p50_ms"]
            rows.append(row)
    return {
        "config": args.config,
        "device": str(engine.device),
        "context": args.context,
        "capture": capture,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"mixed steps, {result['config']} on {result['device']}, context {result['context']}",
        "decoding chunk bucket   graph p50/p99 ms   eager p50/p99 ms  speed-up  host us/replay",
    ]
    for r in result["rows"]:
        g, e = r["graph"], r["eager"]
        lines.append(
            f"{r['decoding']:>8} {r['chunk']:>5} {str(r['bucket']):>6}   "
            f"{g['p50_ms']:7.2f} / {g['p99_ms']:7.2f}   {e['p50_ms']:7.2f} / {e['p99_ms']:7.2f}"
            f"  {r['speedup_p50']:7.2f}x  {r['planner_host_us_per_ragged_replay']:10.1f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for decoding in sorted({r["decoding"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["decoding"] == decoding]
        chunks = [r["chunk"] for r in rows]
        ax.plot(chunks, [r["graph"]["p50_ms"] for r in rows], "o-", label=f"{decoding} graph")
        ax.plot(chunks, [r["eager"]["p50_ms"] for r in rows], "x--", label=f"{decoding} eager")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt chunk (tokens)")
    ax.set_ylabel("step p50 (ms)")
    ax.set_title(f"mixed steps: ragged graph vs eager ({result['config']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv32-shapes", help="a shipped config or a YAML file")
    p.add_argument("--decoding", type=int, nargs="+", default=[16, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--context", type=int, default=2048, help="KV tokens of each decoding request")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here")
    p.add_argument("--smoke", action="store_true", help="the CPU tiny model, a few steps")
    args = p.parse_args()
    if args.smoke:
        args.config, args.decoding, args.chunks = "dsv32-tiny", [2, 4], [8, 32]
        args.context, args.iters, args.warmup = 64, 3, 1
    result = measure(args)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
