#!/usr/bin/env python3
"""Compare the backends.deepgemm references with the real deep_gemm kernels on one GPU.

Run on the CUDA machine (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks deepgemm --out "$OUT/verify_deepgemm.json"

Sections, each over random shapes from a fixed seed:

* ``schedule``: ``get_paged_mqa_logits_metadata`` vs the reference, bit for bit, batch
  1..1024, next_n 1/2, lengths up to 200k, num_sms 132 and smaller; also records which
  layout ("0.1.0" or "new") the installed build matches when the two differ.
* ``logits``: ``fp8_paged_mqa_logits`` vs the fp32 reference on every position below each
  row's length, against an error bound proportional to the magnitude
  ``k_scale * sum_h |w_h| * (|q_h| . |k|)`` (Hopper's fp8 MMA accumulates with reduced
  precision); also checks that both rows of an MTP pair are computed over the LAST
  column's length (the documented "undefined past the row's length" entries).
* ``graph``: CUDA-graph capture and replay of the reference schedule, the real metadata
  kernel and the indexer top-k + sparse MLA path, against eager results.
* ``timing``: a few medians (informative only).

Prints a summary table, writes a JSON summary to ``--out``, exits 1 on any failure.
Without CUDA or deep_gemm it stops with exit 2, unless ``--allow-cpu`` is given, which
exercises the script with the reference standing in for the kernel (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from backends.deepgemm import (
    PAGE,
    SPLIT_KV,
    _native,
    index_cache_views,
    new_index_cache,
    paged_mqa_schedule_into,
    quantize_fp8_e4m3_per_vector,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
    write_index_cache,
)
from backends.nsa import attention as nsa
from benchmarks.common import num_sms_of

GPU_STEPS = {
    "": "--out {out}/verify_deepgemm.json",
}

MAX_LEN_CHOICES = [1, 255, 256, 257, 300, 5000, 65536, 200_000]
KINDS = ["uniform", "equal", "skewed", "splits"]
LOGITS_TOL = 2.0**-9  # |kernel - reference| <= LOGITS_TOL * magnitude bound

# --------------------------------------------------------------------------- cases
# Edge cases come first, then random ones, and every case carries its own seed so a failure
# can be rerun alone; the GPU tests (tests/gpu/test_deepgemm_gpu.py) draw the very same
# shapes from the same seeds.


def make_lens(batch: int, next_n: int, max_len: int, kind: str, seed: int) -> torch.Tensor:
    """CPU int32 ``[batch, next_n]`` per-row causal lengths, all >= 1."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        last = torch.randint(1, max_len + 1, (batch,), generator=g)
    elif kind == "equal":
        last = torch.full((batch,), int(torch.randint(1, max_len + 1, (1,), generator=g)))
    elif kind == "skewed":
        last = torch.randint(1, min(300, max_len) + 1, (batch,), generator=g)
        big = torch.randint(0, batch, (max(1, batch // 16),), generator=g)
        last[big] = torch.randint(max_len // 2 + 1, max_len + 1, (big.numel(),), generator=g)
    else:  # near split boundaries
        m = torch.randint(1, max(2, max_len // SPLIT_KV + 1), (batch,), generator=g) * SPLIT_KV
        last = (m + torch.randint(-1, 2, (batch,), generator=g)).clamp(1, max_len)
    last = last.clamp(min=next_n)  # a planner pads every request to >= next_n tokens
    cols = [last - (next_n - 1 - i) for i in range(next_n)]
    return torch.stack(cols, dim=1).to(torch.int32).contiguous()


def schedule_cases(n: int, seed: int, max_batch: int = 1024) -> list[dict[str, Any]]:
    """Edge cases first, then random ones. Non-132 SM counts use few batch buckets, since
    the metadata kernel is JIT-compiled per (batch rounded up to 32, num_sms)."""
    rng = random.Random(seed)
    cases = [
        dict(batch=1, next_n=1, max_len=200_000, kind="equal", num_sms=132),
        dict(batch=1, next_n=2, max_len=1, kind="equal", num_sms=132),  # 1 unit, 131 idle SMs
        dict(batch=100, next_n=1, max_len=1, kind="equal", num_sms=132),  # total < num_sms
        dict(batch=32, next_n=2, max_len=256, kind="splits", num_sms=132),  # batch == bucket
        dict(batch=min(1024, max_batch), next_n=2, max_len=200_000, kind="uniform", num_sms=132),
        dict(batch=min(1024, max_batch), next_n=1, max_len=200_000, kind="skewed", num_sms=1),
    ]
    small_buckets = [(1, 32), (33, 64), (257, 288), (993, 1024)]
    while len(cases) < n:
        num_sms = rng.choices([132, 1, 8, 78], weights=[7, 1, 1, 1])[0]
        if num_sms == 132:
            pick = rng.random()
            if pick < 0.6:
                batch = rng.randint(1, max_batch)
            elif pick < 0.8:
                batch = rng.choice([1, 2, 31, 32, 33, 64, 65, 1023, 1024])
            else:
                batch = rng.randint(1, 8)
        else:
            lo, hi = rng.choice(small_buckets)
            batch = rng.randint(lo, hi)
        batch = min(batch, max_batch)
        cases.append(
            dict(
                batch=batch,
                next_n=rng.choice([1, 2]),
                max_len=rng.choice(MAX_LEN_CHOICES),
                kind=rng.choice(KINDS),
                num_sms=num_sms,
            )
        )
    for i, c in enumerate(cases):
        c["seed"] = seed * 100_003 + i
    return cases[:n]


def make_logits_inputs(
    batch: int,
    next_n: int,
    heads: int,
    lens: torch.Tensor,
    seed: int,
    device: torch.device,
    dim: int = 128,
) -> tuple[torch.Tensor, ...]:
    """q, a shuffled paged index cache, weights, lens, block table (0 past each request)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-int(n) // PAGE) for n in lens[:, -1].tolist()]
    nb = sum(pages) + 4
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(batch, max(pages) + 1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used : used + p].to(torch.int32)
        used += p
    gd = torch.Generator(device=device).manual_seed(seed)  # bulk data made on the device
    keys = torch.randn(nb * PAGE, dim, generator=gd, device=device)
    k_fp8, k_scale = quantize_fp8_e4m3_per_vector(keys)
    k_scale = k_scale * (torch.rand(nb * PAGE, 1, generator=gd, device=device) + 0.05)
    cache = new_index_cache(nb, dim, device=device)
    write_index_cache(cache, torch.arange(nb * PAGE, device=device), k_fp8, k_scale)
    q = torch.randn(batch, next_n, heads, dim, generator=gd, device=device)
    q_fp8, q_scale = quantize_fp8_e4m3_per_vector(q)
    weights = torch.randn(batch * next_n, heads, generator=gd, device=device)
    weights = (weights * q_scale.reshape(batch * next_n, heads)).contiguous()
    return q_fp8, cache, weights, lens.to(device), table.to(device)


def abs_inputs(q_fp8: torch.Tensor, cache: torch.Tensor, weights: torch.Tensor):
    """Sign-cleared copies: the reference over them is the magnitude bound."""
    q_abs = (q_fp8.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    cache_abs = cache.clone()
    k_view, s_view = index_cache_views(cache_abs)
    k_bytes = k_view.view(torch.uint8)
    k_bytes &= 0x7F
    s_view.abs_()
    return q_abs, cache_abs, weights.abs()


def logits_cases(n: int, seed: int, max_tokens: int = 8_000_000) -> list[dict[str, Any]]:
    """One JIT compile per (next_n, heads), so all four combinations appear early."""
    rng = random.Random(seed + 1)
    cases = [
        dict(batch=1, next_n=1, heads=64, max_len=200_000, kind="equal"),
        dict(batch=3, next_n=2, heads=32, max_len=300, kind="uniform"),
        dict(batch=32, next_n=2, heads=64, max_len=4096, kind="uniform"),
        dict(batch=64, next_n=1, heads=32, max_len=4096, kind="splits"),
    ]
    while len(cases) < n:
        max_len = rng.choice([1, 64, 257, 1000, 8192, 32768, 200_000])
        batch = rng.choice([1, 2, 5, 8, 32, 64, 128, 256])
        batch = max(1, min(batch, max_tokens // max_len))
        cases.append(
            dict(
                batch=batch,
                next_n=rng.choice([1, 2]),
                heads=rng.choice([32, 64]),
                max_len=max_len,
                kind=rng.choice(KINDS),
            )
        )
    for i, c in enumerate(cases):
        c["seed"] = seed * 7919 + i
        c["extra_width"] = rng.choice([0, 0, 1, 63, 700])
    return cases[:n]


# --------------------------------------------------------------------------- checks
# Each check takes the native kernel or ``None`` (the reference stands in, for a smoke run
# on the CPU) and returns the case with its results, so the script's JSON and the GPU tests
# read the same dictionaries.


def first_diff(a: torch.Tensor, b: torch.Tensor) -> Any:
    rows = (a != b).any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return None
    r = rows[0]
    return {"row": r, "got": a[r].tolist(), "want": b[r].tolist(), "rows_differing": len(rows)}


def check_schedule(case: dict[str, Any], native: Callable | None, device: torch.device) -> dict:
    """One schedule case: kernel (or stand-in) vs the CPU and on-device references."""
    lens = make_lens(case["batch"], case["next_n"], case["max_len"], case["kind"], case["seed"])
    n = case["num_sms"]
    ref_old = reference_paged_mqa_schedule(lens, 64, n, "0.1.0")
    ref_new = reference_paged_mqa_schedule(lens, 64, n, "new")
    ref_dev = reference_paged_mqa_schedule(lens.to(device), 64, n, "0.1.0").cpu()
    got = (native or reference_paged_mqa_schedule)(lens.to(device), 64, n).cpu()
    res = dict(case)
    res.update(
        ok=bool(torch.equal(got, ref_old) and torch.equal(ref_dev, ref_old)),
        matches_010=bool(torch.equal(got, ref_old)),
        matches_new=bool(torch.equal(got, ref_new)),
        layouts_differ=not torch.equal(ref_old, ref_new),
        device_ref_ok=bool(torch.equal(ref_dev, ref_old)),
    )
    if not res["matches_010"]:
        res["diff"] = first_diff(got, ref_old)
    return res


def check_logits(case: dict[str, Any], native: Callable | None, device: torch.device) -> dict:
    """One logits case: kernel (or stand-in) vs the reference below each row's length."""
    b, nn, h = case["batch"], case["next_n"], case["heads"]
    lens = make_lens(b, nn, case["max_len"], case["kind"], case["seed"])
    width = int(lens.max()) + case["extra_width"]
    q, cache, w, lens_d, table = make_logits_inputs(b, nn, h, lens, case["seed"], device)
    sched = reference_paged_mqa_schedule(lens, 64, num_sms_of(device)).to(device)
    args = (q, cache, w, lens_d, table, sched, width)
    got = (native or reference_fp8_paged_mqa_logits)(*args, False)
    ref = reference_fp8_paged_mqa_logits(*args)
    # Both MTP rows are computed over the last column's length (what "undefined" hides),
    # so the bound and the unmasked scores use that length for every row.
    last = lens_d[:, -1:].expand(-1, nn).contiguous()
    bound = reference_fp8_paged_mqa_logits(*abs_inputs(q, cache, w), last, table, sched, width)
    valid = torch.isfinite(ref)
    err = (got - ref).abs()
    ratio = torch.where(valid, err / bound.clamp(min=1e-30), torch.zeros_like(err))
    nan_valid = int((valid & ~torch.isfinite(got)).sum())
    x, y = got[valid].double(), ref[valid].double()
    denom = float((x * x + y * y).sum())
    cos_diff = 1.0 - 2.0 * float((x * y).sum()) / denom if denom > 0 else 0.0
    unmasked = reference_fp8_paged_mqa_logits(q, cache, w, last, table, sched, width)
    cover = torch.isfinite(unmasked)
    cover_err = ((got - unmasked).abs() / bound.clamp(min=1e-30))[cover & torch.isfinite(got)]
    covers_last = bool((torch.isfinite(got) | ~cover).all()) and (
        cover_err.numel() == 0 or float(cover_err.max()) <= LOGITS_TOL
    )
    res = dict(case)
    res.update(
        width=width,
        max_err_over_bound=float(ratio.max()) if ratio.numel() else 0.0,
        cos_diff=cos_diff,
        nonfinite_in_valid=nan_valid,
        rows_cover_last_len=covers_last,
        ok=bool(float(ratio.max() if ratio.numel() else 0.0) <= LOGITS_TOL and nan_valid == 0),
    )
    return res


# --------------------------------------------------------------------------- graphs
# Capture once, replay, compare to eager: the schedule (reference and deep_gemm's metadata
# kernel) and the indexer top-k + sparse MLA path must give under replay what they give
# eagerly for new lengths and queries copied into the captured buffers: that is what a
# serving step relies on.


def make_plan(seq_lens: list[int], next_n: int, topk: int, width: int, device, seed: int):
    """A plan object with the planner's attributes (pages scattered at random)."""
    g = torch.Generator().manual_seed(seed)
    reqs = len(seq_lens)
    cap = -(-width // PAGE)
    perm = torch.randperm(reqs * cap, generator=g) + 1  # page 0 is the null page
    slots = torch.zeros(reqs, cap * PAGE, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        t = torch.arange(n)
        slots[r, :n] = (perm[r * cap + t // PAGE] * PAGE + t % PAGE).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    kv = torch.stack([seq - (next_n - 1 - i) for i in range(next_n)], 1).reshape(-1)
    kv = kv.clamp(min=0).to(torch.int32)
    page_table = (slots[:, ::PAGE] // PAGE).contiguous().to(device)
    return SimpleNamespace(
        next_n=next_n,
        kernel_next_n=next_n,  # native rows: deep_gemm takes next_n 1 and 2 as they are
        topk=topk,
        max_seq_len=width,
        kv_lens=kv.to(device),
        token_slots=slots.to(device),
        page_table=page_table,
        kernel_page_table=page_table,
        schedule=reference_paged_mqa_schedule(
            kv.view(-1, next_n), 64, num_sms_of(torch.device(device))
        ).to(device),
        num_slots=(reqs * cap + 1) * PAGE,
    )


def _warm_on_side_stream(fn: Callable[[], Any], times: int = 2) -> None:
    """Warm-up the way torch.cuda.graphs recommends (JIT, cuBLAS workspaces) before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def graph_checks(device: torch.device, dg: Any) -> list[dict]:
    """Capture/replay equality for the schedule and the indexer + sparse MLA path."""
    out: list[dict] = []
    n_sms = num_sms_of(device)

    def record(name: str, fn: Callable[[], bool]) -> None:
        try:
            out.append({"name": name, "ok": bool(fn())})
        except Exception as exc:  # report, keep going
            out.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def ref_schedule_graph() -> bool:
        static = make_lens(200, 2, 5000, "uniform", 1).to(device)
        buf = torch.zeros(n_sms + 1, 2, dtype=torch.int32, device=device)
        _warm_on_side_stream(lambda: paged_mqa_schedule_into(buf, static, 64, n_sms))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            paged_mqa_schedule_into(buf, static, 64, n_sms)
        ok = True
        for s in range(5):
            lens = make_lens(200, 2, [300, 5000, 200_000][s % 3], KINDS[s % 4], 10 + s)
            static.copy_(lens)
            g.replay()
            ok &= torch.equal(buf.cpu(), reference_paged_mqa_schedule(lens, 64, n_sms))
        return ok

    def native_schedule_graph() -> bool:
        static = make_lens(64, 1, 5000, "uniform", 2).to(device)
        _warm_on_side_stream(lambda: dg.get_paged_mqa_logits_metadata(static, 64, n_sms))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = dg.get_paged_mqa_logits_metadata(static, 64, n_sms)
        ok = True
        for s in range(5):
            lens = make_lens(64, 1, [300, 5000, 200_000][s % 3], KINDS[s % 4], 20 + s)
            static.copy_(lens)
            g.replay()
            ok &= torch.equal(res.cpu(), reference_paged_mqa_schedule(lens, 64, n_sms))
        return ok

    def indexer_graph() -> bool:
        seq = [2, 77, 300, 4096, 2, 1000, 64, 65]
        plan = make_plan(seq, 2, 256, 4160, device, seed=3)
        heads = 64
        rows = len(seq) * 2
        g0 = torch.Generator().manual_seed(4)
        k_fp8, k_scale = quantize_fp8_e4m3_per_vector(
            torch.randn(plan.num_slots, 128, generator=g0).to(device)
        )
        cache = new_index_cache(plan.num_slots // PAGE, device=device)
        write_index_cache(cache, torch.arange(plan.num_slots, device=device), k_fp8, k_scale)
        kv = torch.randn(plan.num_slots, 576, generator=g0).to(device, torch.bfloat16)
        q = torch.zeros(rows, heads, 128, device=device, dtype=torch.float8_e4m3fn)
        w = torch.zeros(rows, heads, device=device)
        q_abs = torch.randn(rows, 16, 512, generator=g0).to(device, torch.bfloat16)
        q_rope = torch.randn(rows, 16, 64, generator=g0).to(device, torch.bfloat16)

        def step():
            slots = nsa.indexer_topk(plan, q, w, cache)
            return slots, nsa.sparse_mla_decode(q_abs, q_rope, kv, slots, 192**-0.5)

        def fill(s: int) -> None:
            gg = torch.Generator().manual_seed(100 + s)
            qf, qs = quantize_fp8_e4m3_per_vector(torch.randn(rows, heads, 128, generator=gg))
            q.copy_(qf.to(device))
            w.copy_((torch.randn(rows, heads, generator=gg) * qs.squeeze(-1)).to(device))

        fill(0)
        _warm_on_side_stream(step)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            slots_s, out_s = step()
        ok = True
        for s in range(1, 4):
            fill(s)
            g.replay()
            slots_e, out_e = step()
            ok &= torch.equal(slots_s, slots_e) and torch.equal(out_s, out_e)
        return ok

    if device.type != "cuda":
        return [{"name": "graph", "ok": True, "skipped": "no CUDA"}]
    record("reference schedule_into capture/replay", ref_schedule_graph)
    if dg is not None:
        record("deep_gemm metadata capture/replay", native_schedule_graph)
    record("indexer_topk + sparse_mla_decode capture/replay", indexer_graph)
    return out


# --------------------------------------------------------------------------- timing


def timing(device: torch.device, dg: Any) -> list[dict]:
    """Median times in microseconds (CUDA events, after warm-up); informative only."""
    if device.type != "cuda":
        return []

    def median_us(fn: Callable[[], Any], reps: int = 50) -> float:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        return sorted(times)[len(times) // 2]

    n_sms = num_sms_of(device)
    rows = []
    for batch in (32, 128, 1024):
        lens = make_lens(batch, 1, 8192, "uniform", batch).to(device)
        entry = {"what": f"schedule B={batch}"}
        entry["reference_us"] = median_us(
            lambda lens=lens: reference_paged_mqa_schedule(lens, 64, n_sms, check_values=False)
        )
        if dg is not None:
            entry["deep_gemm_us"] = median_us(
                lambda lens=lens: dg.get_paged_mqa_logits_metadata(lens, 64, n_sms)
            )
        rows.append(entry)
    lens = make_lens(32, 1, 4096, "equal", 5)
    lens.fill_(4096)
    q, cache, w, lens_d, table = make_logits_inputs(32, 1, 64, lens, 5, device)
    sched = reference_paged_mqa_schedule(lens, 64, n_sms).to(device)
    args = (q, cache, w, lens_d, table, sched, 4096)
    entry = {"what": "logits B=32 ctx=4096 H=64"}
    entry["reference_us"] = median_us(lambda: reference_fp8_paged_mqa_logits(*args), 10)
    if dg is not None:
        entry["deep_gemm_us"] = median_us(lambda: dg.fp8_paged_mqa_logits(*args, False))
    rows.append(entry)
    return rows


# --------------------------------------------------------------------------- driver


def summarize(results: dict[str, Any]) -> str:
    lines = [f"{'section':<10} {'cases':>6} {'pass':>6} {'fail':>6}  notes", "-" * 78]
    sched = results["schedule"]
    n_diff = sum(r["layouts_differ"] for r in sched)
    n_new = sum(r["matches_new"] and r["layouts_differ"] for r in sched)
    lines.append(
        f"{'schedule':<10} {len(sched):>6} {sum(r['ok'] for r in sched):>6} "
        f"{sum(not r['ok'] for r in sched):>6}  layouts differ in {n_diff}; kernel matched "
        f"'new' in {n_new} of them"
    )
    lg = results["logits"]
    worst = max((r["max_err_over_bound"] for r in lg), default=0.0)
    cos = max((r["cos_diff"] for r in lg), default=0.0)
    cover = sum(r["rows_cover_last_len"] for r in lg)
    lines.append(
        f"{'logits':<10} {len(lg):>6} {sum(r['ok'] for r in lg):>6} "
        f"{sum(not r['ok'] for r in lg):>6}  worst err/bound {worst:.2e} (tol {LOGITS_TOL:.1e}),"
        f" max cos diff {cos:.1e}, rows cover last len {cover}/{len(lg)}"
    )
    gr = results["graph"]
    lines.append(
        f"{'graph':<10} {len(gr):>6} {sum(r['ok'] for r in gr):>6} "
        f"{sum(not r['ok'] for r in gr):>6}  "
        + "; ".join(f"{r['name']}: {'ok' if r['ok'] else 'FAIL'}" for r in gr)
    )
    for t in results["timing"]:
        extra = f", deep_gemm {t['deep_gemm_us']:.1f} us" if "deep_gemm_us" in t else ""
        lines.append(f"{'timing':<10} {t['what']}: reference {t['reference_us']:.1f} us{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON summary path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule-cases", type=int, default=400)
    p.add_argument("--logits-cases", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--skip-graph", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--allow-cpu", action="store_true", help="smoke-test without CUDA/deep_gemm")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dg = _native.load() if cuda else None
    if dg is None and not args.allow_cpu:
        print("verify_deepgemm: needs CUDA and deep_gemm (or --allow-cpu)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    native_sched = dg.get_paged_mqa_logits_metadata if dg is not None else None
    native_logits = dg.fp8_paged_mqa_logits if dg is not None else None
    t0 = time.time()
    results: dict[str, Any] = {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "num_sms": num_sms_of(device),
            "deep_gemm": getattr(dg, "__version__", None),
            "deep_gemm_header_layout": _native.native_schedule_layout(),
            "stand_in": dg is None,
            "seed": args.seed,
        }
    }
    if dg is None:
        print("WARNING: no deep_gemm: the reference stands in for the kernel (smoke test only)")
    results["errors"] = []

    def run(name: str, fn: Callable[[], list[dict]]) -> None:
        t = time.time()
        try:
            results[name] = fn()
        except Exception:
            results[name] = []
            results["errors"].append({"section": name, "traceback": traceback.format_exc()})
        print(f"[{name}] {len(results[name])} results in {time.time() - t:.1f} s", flush=True)

    run(
        "schedule",
        lambda: [
            check_schedule(c, native_sched, device)
            for c in schedule_cases(args.schedule_cases, args.seed, args.max_batch)
        ],
    )
    run(
        "logits",
        lambda: [
            check_logits(c, native_logits, device)
            for c in logits_cases(args.logits_cases, args.seed)
        ],
    )
    run("graph", lambda: [] if args.skip_graph else graph_checks(device, dg))
    run("timing", lambda: [] if args.skip_timing else timing(device, dg))
    results["wall_s"] = time.time() - t0

    failures = [
        {"section": s, **r}
        for s in ("schedule", "logits", "graph")
        for r in results[s]
        if not r.get("ok", False)
    ]
    results["failures"] = failures[:50]
    results["ok"] = not failures and not results["errors"]
    print(summarize(results))
    for f in failures[:10]:
        print("FAIL", json.dumps(f, default=str)[:600])
    for e in results["errors"]:
        print(f"ERROR in {e['section']}:\n{e['traceback']}")
    print(f"overall: {'OK' if results['ok'] else 'FAILED'} in {results['wall_s']:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
