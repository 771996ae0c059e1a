#!/usr/bin/env python3
"""The whole DeepSeek-V3.2 decode step under CUDA graphs, beside its HBM floor.

For each (batch, context): the dsv32-shapes model (61 layers, real attention and
indexer dimensions, dense FFN stand-in) decodes one token per request through the
planner and one captured graph, with the reference attention (torch sparse MLA) and
with the production kernels (Triton split-KV sparse MLA, length-aware Triton top-k),
side by side. The floor is the bytes a step must read once, over the card's copy
bandwidth measured in the same run:

- every weight (the stand-in FFN reads all of its weights at any batch);
- the index cache the indexer scores: each request's whole context, 132 bytes a token,
  in every layer;
- the latent cache sparse MLA reads: ``min(ctx, topk)`` tokens of 1152 bytes per
  request per layer.

All layers share one KV cache (as in ``seed_stack --stack model``: the weights would
not leave room for 61 real ones at B=128, 16k); each layer still reads a whole cache,
but at small batches that cache fits in L2, so measured steps there can beat the
floor's KV part. The floor is reported as ``step / floor``.

    python3 -m benchmarks model_floor --out $OUT/model_floor.json --plot $OUT/model_floor.png
"""

from __future__ import annotations

import argparse
import gc
import random
import warnings

import torch

from benchmarks.common import (
    machine,
    plot_bars,
    print_table,
    sync,
    time_calls,
    write_json,
)
from benchmarks.kernels.seed_stack import make_batch, model_stack, stack_limits
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.plan_setup import flashinfer_options
from graphs import GraphRunner
from planner import Planner

GPU_STEPS = {
    "": "--out {out}/model_floor.json",
}

KERNELS = {"reference": "torch", "production": "auto", "flashinfer": "flashinfer"}
"""Sparse MLA per variant: the torch reference, the NSA plan's Triton kernel, and
FlashInfer's MLA kernel planned once per batch (the ``nsa_flashinfer`` companion plan)."""


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second of a large device-to-device copy (median)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * src.numel() / (t["median_ms"] * 1e-3)


def floor_bytes(model: DSV32Model, batch: int, ctx: int) -> int:
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    index = batch * ctx * cfg.index_cache_dim * cfg.num_hidden_layers
    latent = batch * min(ctx, cfg.index_topk) * cfg.kv_cache_dim * model.dtype.itemsize
    return weights + index + latent * cfg.num_hidden_layers


def graph_runner(model, setup, kernel: str, batch: int, ctx: int, device) -> GraphRunner:
    """The model stack's planner (NSA, ``kernel`` for sparse MLA) and a runner of one size."""
    table, num_pages, forward, nsa_options = setup
    limits = stack_limits(batch, ctx, num_pages, device)
    fi = kernel == "flashinfer"
    nsa = {
        **nsa_options,
        "mla_heads": model.attention_heads,
        "mla_kernel": "auto" if fi else kernel,
    }
    options = {"nsa": nsa}
    if fi:
        options["nsa_flashinfer"] = flashinfer_options(model, device)
    planner = Planner(["nsa", "nsa_flashinfer"] if fi else ["nsa"], limits, options=options)
    return GraphRunner(planner, forward, req_to_token=table, sizes=[batch])


def step_time(model, setup, kernel: str, batch: int, ctx: int, device, args) -> dict:
    table = setup[0]
    runner = graph_runner(model, setup, kernel, batch, ctx, device)
    rng = random.Random(args.seed)
    batches = [make_batch(table, batch, ctx, rng) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.capture()
        timing = time_calls(
            lambda i: runner.step(batches[i % len(batches)]),
            device,
            warmup=args.warmup,
            iters=args.iters,
        )
    replays = runner.stats.graph_steps
    runner.close()
    return {**timing, "graph_replays": replays}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="dsv32 decode step under graphs vs its HBM floor")
    p.add_argument("--preset", default="shapes", help="model preset (tiny for a CPU smoke test)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), default=list(KERNELS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG plot")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = DSV32Model(DSV32Config.preset(args.preset), seed=args.seed, device=device, dtype=dtype)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results = []
    for ctx in args.contexts:
        for batch in args.batches:
            setup = model_stack(args, batch, ctx, device, model)
            row = {"batch": batch, "ctx": ctx, "floor_bytes": floor_bytes(model, batch, ctx)}
            row["floor_ms"] = 1e3 * row["floor_bytes"] / bandwidth
            for name in args.kernels:
                row[name] = step_time(model, setup, KERNELS[name], batch, ctx, device, args)
                ms = row[name]["median_ms"]
                print(
                    f"ctx {ctx} B {batch} {name}: {ms:.3f} ms (p99 {row[name]['p99_ms']:.3f}), "
                    f"floor {row['floor_ms']:.3f} ms, step/floor {ms / row['floor_ms']:.2f}",
                    flush=True,
                )
            results.append(row)
            del setup
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            sync(device)
    rows = []
    for r in results:
        cells = [r["ctx"], r["batch"], r["floor_ms"]]
        for name in args.kernels:
            cells += [r[name]["median_ms"], r[name]["p99_ms"], r[name]["median_ms"] / r["floor_ms"]]
        rows.append(tuple(cells))
    headers = ["ctx", "batch", "floor ms"]
    for name in args.kernels:
        headers += [f"{name} ms", f"{name} p99", f"{name}/floor"]
    table = print_table(f"{args.preset} decode step under CUDA graphs", tuple(headers), rows)
    write_json(
        args.out,
        {
            "machine": machine(),
            "args": vars(args),
            "copy_bandwidth": bandwidth,
            "results": results,
            "table": table,
        },
    )
    plot_bars(
        args.plot,
        f"{args.preset} decode step under graphs vs HBM floor",
        [f"B{r['batch']} {r['ctx'] // 1024}k" for r in results],
        {
            "floor": [r["floor_ms"] for r in results],
            **{name: [r[name]["median_ms"] for r in results] for name in args.kernels},
        },
        "ms per step (median)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
