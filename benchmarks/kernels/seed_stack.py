#!/usr/bin/env python3
"""The seed's claim, reproduced: the deep_gemm schedule per layer vs once per batch.

Three ways to give 61 indexer layers their paged-MQA schedule, same layers,
same data, same planner for everything else:

  (a) per-layer: every layer calls ``get_paged_mqa_logits_metadata`` again
      (the pre-seed code path); the other metadata is refreshed outside the graph;
  (b) seed: the planner computes all metadata once per batch outside the
      graph and the graph reads the static copies (``ops_in_graph=False``);
  (c) planner: the planner's ops, the schedule included, recorded once inside
      the graph before the layers (``ops_in_graph=True``).

Each is timed eagerly and under CUDA graphs: wall time of one step (planner
work + forward + sync), median over ``--iters`` after ``--warmup``.

``--stack indexer`` (default): each layer is the lightning indexer's
``fp8_paged_mqa_logits`` + top-2048 (64 heads x 128, block 64) over its own
fp8 index cache. ``--stack model``: the ``dsv32-shapes`` DeepSeek-V3.2 (61 layers,
real attention/indexer dims, dense FFN stand-in) with one KV cache shared by
all layers (memory; timing per layer is unaffected since every layer reads
its full cache), decoding one token per request.

    python3 -m benchmarks seed_stack --out $OUT/seed_stack.json --plot $OUT/seed_stack.png
"""

from __future__ import annotations

import argparse
import gc
import random
import warnings
from typing import Any

import torch

from backends.deepgemm import (
    _native,
    new_index_cache,
    quantize_fp8_e4m3_per_vector,
    reference_paged_mqa_schedule,
    write_index_cache,
)
from backends.nsa import warmup_schedule_buckets
from backends.nsa.attention import indexer_topk
from benchmarks.common import (
    machine,
    num_sms_of,
    plot_bars,
    print_table,
    sync,
    time_calls,
    write_json,
)
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import PagedKVCache
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.serving.plan_setup import flashinfer_options
from graphs import GraphRunner
from planner import ForwardBatch, Limits, Planner

GPU_STEPS = {
    "": "--stack model --contexts 4096 --batches 1 16 64 --modes graph --runs 2 --warmup 5 --iters 20 --out {out}/model_seed.json",
    "fi": "--stack model --contexts 4096 --batches 1 16 64 --modes graph --runs 2 --warmup 5 --iters 20 --mla-kernel flashinfer --out {out}/model_seed_fi.json",
}

VARIANTS = ("a_per_layer", "b_seed", "c_planner")


class PerLayerSchedule:
    """A plan whose ``schedule`` is recomputed at every read, as each pre-seed layer did."""

    def __init__(self, plan: Any, num_sms: int) -> None:
        self._plan = plan
        self._num_sms = num_sms
        self.computed = 0

    def __getattr__(self, name: str) -> Any:
        if name != "schedule":
            return getattr(self._plan, name)
        self.computed += 1
        lens = self._plan.kv_lens.view(-1, self._plan.next_n)

        dg = _native.load() if lens.is_cuda else None
        if dg is not None:
            return dg.get_paged_mqa_logits_metadata(lens, 64, self._num_sms)
        return reference_paged_mqa_schedule(lens, 64, self._num_sms, check_values=False)


def make_table(batch: int, ctx: int, device: torch.device, seed: int):
    """A request pool: request r (1..batch) owns its own shuffled pages; row 0 is the null request."""
    pages_per_req = -(-ctx // 64)
    total = batch * pages_per_req
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(total, generator=g) + 1).view(batch, pages_per_req)
    slots = (pages[:, :, None] * 64 + torch.arange(64)).reshape(batch, -1)[:, :ctx]
    table = torch.zeros(batch + 1, ctx, dtype=torch.int32)
    table[1:] = slots.to(torch.int32)
    return table.to(device), total + 1


def make_batch(table, batch: int, ctx: int, rng: random.Random):

    return batch_of(table, [rng.randint(ctx - ctx // 8, ctx) for _ in range(batch)])


def batch_of(table: torch.Tensor, lens: list[int]) -> ForwardBatch:
    """A decode batch of requests ``1..len(lens)`` of ``table`` with these lengths."""
    seq = torch.tensor(lens, dtype=torch.int32)
    pool = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    loc = table[pool.to(table.device).long(), (seq - 1).to(table.device).long()].cpu()
    return ForwardBatch(
        seq_lens_cpu=seq,
        req_pool_indices=pool,
        req_to_token=table,
        out_cache_loc=loc,
        positions=(seq - 1).to(torch.int32),
    )


def random_index_caches(
    layers: int, num_pages: int, device: torch.device, seed: int
) -> list[torch.Tensor]:
    """Valid fp8 keys and scales (no NaN bit patterns), one cache per layer."""

    g = torch.Generator(device=device).manual_seed(seed)
    base = new_index_cache(num_pages, 128, device)
    slots = torch.arange(num_pages * 64, device=device)
    for chunk in slots.split(1 << 20):
        keys = torch.randn(chunk.numel(), 128, device=device, generator=g, dtype=torch.bfloat16)
        k_fp8, k_scale = quantize_fp8_e4m3_per_vector(keys)
        write_index_cache(base, chunk, k_fp8, k_scale.squeeze(-1))
    return [base.clone() for _ in range(layers)]


def indexer_stack(args, batch: int, ctx: int, device: torch.device):
    """Forward of 61 indexer layers and what it needs, for one (batch, ctx)."""

    table, num_pages = make_table(batch, ctx, device, args.seed)
    caches = random_index_caches(args.layers, num_pages, device, args.seed)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    q = torch.randn(batch, 1, 64, 128, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(batch, 64, device=device, generator=g) * 0.05

    def forward(inputs, plans, plan_of=lambda p: p):
        plan = plan_of(plans["nsa"])
        out = None
        for cache in caches:
            out = indexer_topk(plan, q, w, cache)
        return out

    return table, num_pages, forward, {"topk": 2048}


def model_stack(args, batch: int, ctx: int, device: torch.device, model):

    table, num_pages = make_table(batch, ctx, device, args.seed)
    cfg = model.config
    cache = object.__new__(PagedKVCache)  # all layers share one cache (see the module docstring)
    cache.config, cache.page_size, cache.num_pages, cache.device, cache.dtype = (
        cfg,
        64,
        num_pages,
        device,
        model.dtype,
    )
    mla = torch.randn(num_pages * 64, cfg.kv_cache_dim, device=device, dtype=model.dtype) * 0.1
    index = random_index_caches(1, num_pages, device, args.seed)[0]
    cache.mla, cache.index = [mla] * cfg.num_hidden_layers, [index] * cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)

    def forward(inputs, plans, plan_of=lambda p: p):
        sparse = plans.get("nsa_flashinfer")  # FlashInfer's sparse MLA plan, when planned
        extra = {} if sparse is None else {"nsa_flashinfer": sparse}
        return model(ids, {"nsa": plan_of(plans["nsa"]), **extra}, cache)

    return table, num_pages, forward, {"topk": cfg.index_topk}


def stack_limits(batch: int, ctx: int, num_pages: int, device: torch.device) -> Limits:
    """One capture size of ``batch`` at ``ctx``, over a stack's ``num_pages`` 64-token pages."""
    return Limits(
        max_batch=batch,
        max_context=ctx,
        page_size=64,
        num_sms=num_sms_of(device),
        kv_slots=num_pages * 64,
        device=str(device),
    )


def run_variant(
    variant: str, graphs: bool, batch: int, ctx: int, setup, device, args
) -> dict[str, Any]:

    table, num_pages, forward, nsa_options = setup
    limits = stack_limits(batch, ctx, num_pages, device)
    sms = limits.num_sms
    companions = getattr(args, "companions", {})  # FlashInfer's sparse MLA plan, if asked
    planner = Planner(
        ["nsa", *companions],
        limits,
        options={"nsa": nsa_options, **companions},
        ops_in_graph=(variant == "c_planner"),
    )
    proxies: list[PerLayerSchedule] = []

    def plan_of(plan):
        if variant != "a_per_layer":
            return plan
        proxy = PerLayerSchedule(plan, sms)
        proxies.append(proxy)
        return proxy

    runner = GraphRunner(
        planner,
        lambda inputs, plans: forward(inputs, plans, plan_of),
        req_to_token=table,
        sizes=[batch],
        enabled=graphs,
        warmup=lambda p, bs: warmup_schedule_buckets(batch, 1, sms, device),
    )
    rng = random.Random(args.seed)
    batches = [make_batch(table, batch, ctx, rng) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.capture()
        calls_before = planner.stats.op_calls["paged_mqa_schedule"]
        proxies.clear()
        timing = time_calls(
            lambda i: runner.step(batches[i % len(batches)]),
            device,
            warmup=args.warmup,
            iters=args.iters,
        )
    steps = args.warmup + args.iters
    per_step = (planner.stats.op_calls["paged_mqa_schedule"] - calls_before) / steps
    if variant == "a_per_layer":
        per_step = sum(p.computed for p in proxies) / steps if not graphs else args.layers_in_stack
    runner.close()
    return {**timing, "schedules_per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="per-layer vs once-per-batch deep_gemm schedule (the seed)"
    )
    p.add_argument("--stack", choices=("indexer", "model"), default="indexer")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--layers", type=int, default=61, help="indexer layers (indexer stack)")
    p.add_argument(
        "--preset",
        default="shapes",
        help="model preset for --stack model (tiny for a CPU smoke test)",
    )
    p.add_argument(
        "--mla-kernel",
        choices=("auto", "flashinfer"),
        default="auto",
        help="model stack's sparse MLA: the NSA plan's kernel (Triton on CUDA), or FlashInfer's "
        "planned once per batch (the same in all three variants)",
    )
    p.add_argument("--modes", nargs="+", choices=("eager", "graph"), default=["eager", "graph"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--runs", type=int, default=2, help="repeat the whole comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--plot", help="PNG plot")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = None
    if args.stack == "model":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = DSV32Model(
            DSV32Config.preset(args.preset), seed=args.seed, device=device, dtype=dtype
        )
        args.layers_in_stack = model.config.num_hidden_layers
        if args.mla_kernel == "flashinfer":
            args.companions = {"nsa_flashinfer": flashinfer_options(model, device)}
    else:
        args.layers_in_stack = args.layers
    results = []
    for run in range(args.runs):
        for ctx in args.contexts:
            for batch in args.batches:
                setup = (
                    indexer_stack(args, batch, ctx, device)
                    if model is None
                    else model_stack(args, batch, ctx, device, model)
                )
                for mode in args.modes:
                    row = {"run": run, "batch": batch, "ctx": ctx, "mode": mode}
                    for variant in VARIANTS:
                        row[variant] = run_variant(
                            variant, mode == "graph", batch, ctx, setup, device, args
                        )
                    a, b, c = (row[v]["median_ms"] for v in VARIANTS)
                    row.update(b_over_a=b / a, c_over_a=c / a, c_over_b=c / b)
                    results.append(row)
                    print(
                        f"run {run} ctx {ctx} batch {batch} {mode}: a {a:.3f} b {b:.3f} c {c:.3f} ms  "
                        f"b/a {b / a:.3f} c/a {c / a:.3f} c/b {c / b:.3f}",
                        flush=True,
                    )
                del setup
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                sync(device)
    rows = [
        (
            r["run"],
            r["ctx"],
            r["batch"],
            r["mode"],
            *(r[v]["median_ms"] for v in VARIANTS),
            r["b_over_a"],
            r["c_over_a"],
            r["c_over_b"],
            r["a_per_layer"]["schedules_per_step"],
            r["c_planner"]["schedules_per_step"],
        )
        for r in results
    ]
    table = print_table(
        f"seed reproduction, {args.stack} stack ({args.layers_in_stack} layers), step median ms",
        (
            "run",
            "ctx",
            "batch",
            "mode",
            "a per-layer",
            "b seed",
            "c planner",
            "b/a",
            "c/a",
            "c/b",
            "sched/step a",
            "sched/step c",
        ),
        rows,
    )
    write_json(
        args.out, {"machine": machine(), "args": vars(args), "results": results, "table": table}
    )
    graph_rows = [r for r in results if r["mode"] == "graph" and r["run"] == 0]
    plot_bars(
        args.plot,
        f"{args.stack} stack under CUDA graphs: step time by schedule placement",
        [f"B{r['batch']} {r['ctx'] // 1024}k" for r in graph_rows],
        {v: [r[v]["median_ms"] for r in graph_rows] for v in VARIANTS},
        "ms per step (median)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
