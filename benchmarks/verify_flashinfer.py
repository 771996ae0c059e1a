#!/usr/bin/env python3
"""Verify the FlashInfer backends on one GPU: eager, capture and replay against the torch reference.

Run on the CUDA machine (flashinfer-python 0.5.3 among the carried wheels)::

    source scripts/device_prelude.sh || exit 1
    python3 benchmarks/verify_flashinfer.py --out "$OUT/verify_flashinfer.json"

For each configuration (paged decode: page 1 GQA, page 16 MHA, page 16 GQA on
tensor cores; MLA: page 1, page 64, page 64 target-verify with causal rows) a
planner is built on CUDA, every capture size is captured into one CUDA graph
pool (``planner.capture``, warm-up forward, ``torch.cuda.graph`` around
``planner.record`` + the attention forward), then ``--sequences`` random
batches (sizes 1..max_batch, lengths short, long, uniform or equal) go through:

* eager: ``planner.plan`` + the forward with FlashInfer's eager wrapper;
* replay: ``planner.replay`` + ``graph.replay()`` on the next captured size;
* the fp32 torch reference over the eager plan's fields.

Checks per batch: both outputs within bf16 tolerance of the reference (the
capture-time warm-up output too, for the dummy batch); ``planner.verify``
(replayed metadata bit-equal to an eager plan padded alike, padding rows
holding pad values); plan tensors at their captured addresses; the graph
wrapper the same object, bound to exactly the plan's tensors; no synchronising
CUDA call on the replay path (``torch.cuda.set_sync_debug_mode("warn")``).
Prints a summary table, writes JSON to ``--out``, exits 1 on any failure and 2
without CUDA or flashinfer unless ``--allow-cpu`` (a smoke test of this script
with the reference standing in for FlashInfer and graphs emulated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.flashinfer import flashinfer_importable  # noqa: E402
from backends.flashinfer.wrappers import load_flashinfer  # noqa: E402
from benchmarks.flashinfer_configs import CONFIGS, cpu_smoke  # noqa: E402
from benchmarks.flashinfer_replay import run_config  # noqa: E402
from benchmarks.flashinfer_report import ATOL, RTOL, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON summary path")
    p.add_argument("--sequences", type=int, default=100, help="random batches per config")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--mla-backend", default=None, help="force fa2/fa3 for the MLA configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-cpu", action="store_true", help="smoke-test without CUDA/flashinfer")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    usable = cuda and flashinfer_importable()
    if not usable and not args.allow_cpu:
        print("verify_flashinfer: needs CUDA and flashinfer (or --allow-cpu)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        print(
            f"verify_flashinfer: unknown configs {unknown}; known: {sorted(CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    if not usable:
        print("WARNING: no CUDA/flashinfer: the torch reference stands in (smoke test only)")
    t0 = time.time()
    reports = []
    for name in names:
        config = CONFIGS[name]
        if args.mla_backend and config.backend == "flashinfer_mla":
            config = replace(config, mla_backend=args.mla_backend)
        if not usable:
            config = cpu_smoke(config)
        t = time.time()
        report = run_config(name, config, device, args.sequences, args.seed)
        reports.append(report)
        state = "ok" if report.ok else "FAILED"
        print(
            f"[{name}] {report.steps} batches, capture {report.capture_s:.1f} s, {time.time() - t:.1f} s: {state}",
            flush=True,
        )
    results = {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "flashinfer": _flashinfer_version() if usable else None,
            "stand_in": not usable,
            "seed": args.seed,
            "sequences": args.sequences,
            "atol": ATOL,
            "rtol": RTOL,
        },
        "configs": [r.to_json() for r in reports],
        "wall_s": time.time() - t0,
    }
    results["ok"] = all(r.ok for r in reports)
    print(summarize(reports))
    for r in reports:
        for f in r.failures[:5]:
            print(f"FAIL [{r.name}] {f}")
        if r.error:
            print(f"ERROR [{r.name}]\n{r.error}")
    print(f"overall: {'OK' if results['ok'] else 'FAILED'} in {results['wall_s']:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if results["ok"] else 1


def _flashinfer_version() -> str | None:

    return getattr(load_flashinfer(), "__version__", None)


if __name__ == "__main__":
    sys.exit(main())
