#!/usr/bin/env python3
"""Compare the backends.deepgemm references with the real deep_gemm kernels on one GPU.

Run on the CUDA machine (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 benchmarks/verify_deepgemm.py --out "$OUT/verify_deepgemm.json"

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
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.deepgemm import (  # noqa: E402
    _native,
    reference_fp8_paged_mqa_logits,
    reference_paged_mqa_schedule,
)
from benchmarks.common import num_sms_of  # noqa: E402
from benchmarks.deepgemm_cases import (  # noqa: E402
    logits_cases,
    make_lens,
    make_logits_inputs,
    schedule_cases,
)
from benchmarks.deepgemm_checks import LOGITS_TOL, check_logits, check_schedule  # noqa: E402
from benchmarks.deepgemm_graphs import graph_checks  # noqa: E402

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
