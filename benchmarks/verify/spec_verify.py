#!/usr/bin/env python3
"""Expanded-row target verify under real CUDA graphs with real deep_gemm: schedule and logits.

Run on the CUDA machine with sgl-deep-gemm 0.1.0 (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks spec_verify --out "$OUT"

deep_gemm's paged MQA logits take ``next_n`` 1 or 2 on Hopper; a verify of 4 draft tokens
is planned expanded: one kernel request per row, staircase lengths, the page table
repeated per row, the schedule over the expanded rows with next_n 1. This script builds
an NSA planner for ``--next-n`` (4) and a graph runner whose forward is the indexer's
logits call (``backends.deepgemm.fp8_paged_mqa_logits``, the real kernel on CUDA) over the
plan's ``kernel_page_table``, ``kv_lens`` and ``schedule``, captures real CUDA graphs at
sizes 1..32, and replays random verify batches (edge lengths at page and 256-token split
boundaries, padded batch sizes). After each replay it requires:

* the plan as replayed equal to an eager plan of the padded batch, bit for bit, with the
  layout expected: ``kernel_next_n`` 1, ``kv_lens`` the staircase, ``kernel_page_table``
  the page table repeated ``next_n`` times;
* the schedule the graph computed equal, bit for bit, to deep_gemm's own
  ``get_paged_mqa_logits_metadata`` over the expanded ``[rows, 1]`` lengths (called
  eagerly) and to the reference ``reference_paged_mqa_schedule``;
* the logits equal to ``reference_fp8_paged_mqa_logits`` over every row's valid
  positions, ``|got - ref| <= 2^-9 x`` the magnitude bound (the reference over
  sign-cleared inputs), as ``benchmarks/verify/deepgemm.py`` checks the kernel.

A second part runs ``next_n`` 2 both ways, native and expanded (``native_next_n (1,)``),
through graphs, and requires both logits to meet the same bound against the reference:
expansion is the native layout's twin on the real kernel. Writes
``verify_spec_verify.json`` under ``--out``, prints a summary, exits 1 on any failure.
Without CUDA and deep_gemm it stops with exit 2, unless ``--smoke``: small cases on the
CPU with emulated graphs and the references standing in for the kernels
(tests/planner/test_gpu_scripts.py runs it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from backends.deepgemm import (
    _native,
    fp8_paged_mqa_logits,
    index_cache_views,
    new_index_cache,
    quantize_fp8_e4m3_per_vector,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
    write_index_cache,
)
from benchmarks.common import num_sms_of
from graphs import GraphRunner
from graphs.inputs import InputSpec
from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from planner.debug import diff_plans

GPU_STEPS = {
    "": "--out {out}",
}

PAGE, TOL = 64, 2.0**-9
VERIFY = ForwardMode.TARGET_VERIFY


def table_and_cache(reqs: int, max_context: int, seed: int, device: torch.device):
    """A token table whose requests own shuffled pages, and a random fp8 index cache."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-max_context // PAGE)
    perm = (torch.randperm(reqs * pages, generator=g) + 1).view(reqs, pages)
    table = torch.zeros(reqs + 1, pages * PAGE, dtype=torch.int32)
    offsets = torch.arange(PAGE, dtype=torch.int32)
    table[1:] = (perm[:, :, None] * PAGE + offsets).reshape(reqs, -1).to(torch.int32)
    slots = (reqs * pages + 1) * PAGE
    keys, scales = quantize_fp8_e4m3_per_vector(torch.randn(slots, 128, generator=g))
    cache = new_index_cache(reqs * pages + 1)
    write_index_cache(cache, torch.arange(slots), keys, scales)
    return table[:, :max_context].contiguous().to(device), cache.to(device)


def abs_inputs(q: torch.Tensor, cache: torch.Tensor, w: torch.Tensor):
    """Sign-cleared copies: the reference over them bounds every rounding error."""
    q_abs = (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    cache_abs = cache.clone()
    keys, scales = index_cache_views(cache_abs)
    keys.view(torch.uint8).bitwise_and_(0x7F)
    scales.abs_()
    return q_abs, cache_abs, w.abs()


def verify_batch(rng: random.Random, table: torch.Tensor, bs: int, n: int, max_len: int):
    edges = (n, 63, 64, 65, 255, 256, 257, 1024, max_len)
    lens = [
        max(n, rng.choice(edges)) if rng.random() < 0.4 else rng.randint(n, max_len)
        for _ in range(bs)
    ]
    reqs = rng.sample(range(1, table.shape[0]), bs)
    host = table.cpu()
    locs = [int(host[r, p]) for r, k in zip(reqs, lens) for p in range(k - n, k)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=torch.tensor(reqs, dtype=torch.int32),
        req_to_token=table,
        out_cache_loc=torch.tensor(locs, dtype=torch.int32),
        mode=VERIFY,
        next_n=n,
    )


class Part:
    """One planner (``next_n``, native set) with its graph runner over the logits call."""

    def __init__(self, args, next_n: int, native, table, cache, device, sms: int) -> None:
        limits = Limits(
            max_batch=args.max_batch,
            max_context=args.max_context,
            next_n=next_n,
            num_sms=sms,
            device=str(device),
        )
        options = {"topk": 2048, **({} if native is None else {"native_next_n": native})}
        self.planner = Planner(["nsa"], limits, options={"nsa": options})
        self.cache, self.heads, self.n = cache, args.heads, next_n
        self.runner = GraphRunner(
            self.planner,
            self.forward,
            req_to_token=table,
            static_inputs={
                "q": InputSpec(torch.uint8, (args.heads, 128)),
                "w": InputSpec(torch.float32, (args.heads,)),
            },
            modes=[VERIFY],
            sizes=[s for s in (1, 2, 4, 8, 16, 32) if s <= args.max_batch],
        )
        self.runner.capture()

    def forward(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> dict[str, torch.Tensor]:
        plan = plans["nsa"]
        kn, rows = plan.kernel_next_n, plan.kv_lens.shape[0]
        q = inputs["q"].view(torch.float8_e4m3fn).view(rows // kn, kn, self.heads, 128)
        logits = fp8_paged_mqa_logits(
            q,
            self.cache,
            inputs["w"],
            plan.kv_lens.view(rows // kn, kn),
            plan.kernel_page_table,
            plan.schedule,
            plan.max_seq_len,
        )
        return {"logits": logits}


def check(part: Part, batch: ForwardBatch, rng: random.Random, device, sms: int) -> dict[str, Any]:
    rows = batch.bs * part.n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q, _ = quantize_fp8_e4m3_per_vector(torch.randn(rows, part.heads, 128, generator=g))
    w = torch.rand(rows, part.heads, generator=g) + 0.05
    q, w = q.to(device), w.to(device)
    got = part.runner.step(batch, {"q": q.view(torch.uint8), "w": w})["logits"].clone()
    plans = part.runner.last_plans
    plan = plans["nsa"]
    size = plans.reqs
    res: dict[str, Any] = {
        "bs": batch.bs,
        "graph_bs": size,
        "max_len": int(batch.seq_lens_cpu.max()),
    }
    res["replayed"] = plans.phase == "replay"
    res["plan_equals_eager"] = not diff_plans(plans, part.planner.plan(batch, pad_to=size))
    lens = batch.seq_lens_cpu.tolist()
    stair = [k - (part.n - 1 - i) for k in lens for i in range(part.n)]
    expanded = plan.kernel_next_n == 1
    repeat = part.n if expanded else 1
    res["layout"] = "expanded" if expanded else "native"
    res["layout_ok"] = bool(
        plan.kv_lens[:rows].tolist() == stair
        and torch.equal(plan.kernel_page_table, plan.page_table.repeat_interleave(repeat, 0))
    )
    kn = plan.kernel_next_n
    kernel_lens = plan.kv_lens.view(-1, kn).contiguous()
    ref_sched = reference_paged_mqa_schedule(kernel_lens.cpu(), PAGE, sms)
    res["schedule_equals_reference"] = bool(torch.equal(plan.schedule.cpu(), ref_sched))
    dg = _native.load() if device.type == "cuda" else None
    if dg is not None:
        native_sched = dg.get_paged_mqa_logits_metadata(kernel_lens, PAGE, sms)
        res["schedule_equals_deep_gemm"] = bool(torch.equal(plan.schedule, native_sched))
    width = plan.max_seq_len
    kreqs = rows // kn
    args = (
        plan.kv_lens[:rows].view(kreqs, kn),
        plan.kernel_page_table[:kreqs],
        reference_paged_mqa_schedule(plan.kv_lens[:rows].view(kreqs, kn), PAGE, sms),
        width,
    )
    q4 = q.view(kreqs, kn, part.heads, 128)
    ref = reference_fp8_paged_mqa_logits(q4, part.cache, w, *args)
    bound = reference_fp8_paged_mqa_logits(*abs_inputs(q4, part.cache, w), *args)
    valid = torch.isfinite(ref)
    err = torch.where(valid, (got - ref).abs() / bound.clamp(min=1e-30), torch.zeros_like(ref))
    res["max_err_over_bound"] = float(err.max())
    res["nonfinite_in_valid"] = int((valid & ~torch.isfinite(got)).sum())
    res["ok"] = bool(
        res["replayed"]
        and res["plan_equals_eager"]
        and res["layout_ok"]
        and res["schedule_equals_reference"]
        and res.get("schedule_equals_deep_gemm", True)
        and res["max_err_over_bound"] <= TOL
        and res["nonfinite_in_valid"] == 0
    )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    p.add_argument("--smoke", action="store_true", help="CPU, emulated graphs, references")
    p.add_argument("--cases", type=int, default=None, help="verify batches per part")
    p.add_argument("--next-n", type=int, default=4)
    p.add_argument("--heads", type=int, default=64, choices=(32, 64))
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and _native.available()
    if not cuda and not args.smoke:
        print("needs CUDA and deep_gemm (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda and not args.smoke else "cpu")
    args.cases = args.cases or (4 if args.smoke else 40)
    args.max_batch = args.max_batch or (4 if args.smoke else 32)
    args.max_context = args.max_context or (512 if args.smoke else 4096)
    sms = num_sms_of(device)
    rng = random.Random(args.seed)
    table, cache = table_and_cache(2 * args.max_batch, args.max_context, args.seed, device)
    start = time.perf_counter()
    parts = {
        f"next_n={args.next_n} (expanded)": Part(
            args, args.next_n, None, table, cache, device, sms
        ),
        "next_n=2 native": Part(args, 2, None, table, cache, device, sms),
        "next_n=2 expanded": Part(args, 2, (1,), table, cache, device, sms),
    }
    report: dict[str, Any] = {"device": str(device), "num_sms": sms, "parts": {}}
    failed = 0
    for name, part in parts.items():
        n_cases = args.cases if "expanded)" in name else max(2, args.cases // 4)
        results = []
        for _ in range(n_cases):
            batch = verify_batch(
                rng, table, rng.randint(1, args.max_batch), part.n, args.max_context
            )
            results.append(check(part, batch, rng, device, sms))
        stats = part.runner.stats.summary()
        ok = all(r["ok"] for r in results)
        failed += not ok
        report["parts"][name] = {
            "ok": ok,
            "cases": len(results),
            "failures": [r for r in results if not r["ok"]][:5],
            "worst_err_over_bound": max(r["max_err_over_bound"] for r in results),
            "schedule_provider": part.planner.providers_chosen(VERIFY)["nsa.schedule"],
            "graph_kind": stats["kind"],
            "graph_replays": stats["graph_steps"],
            "eager_fallbacks": stats["eager_fallbacks"],
            "layouts": sorted({r["layout"] for r in results}),
        }
        print(
            f"{name:24s} {'ok' if ok else 'FAIL'}: {len(results)} batches, "
            f"{stats['graph_steps']} {stats['kind']} replays, worst err/bound "
            f"{report['parts'][name]['worst_err_over_bound']:.2e} (tol {TOL:.1e}), schedule via "
            f"{report['parts'][name]['schedule_provider']}",
            flush=True,
        )
    report["seconds"] = time.perf_counter() - start
    report["ok"] = not failed
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "verify_spec_verify.json").write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
