#!/usr/bin/env python3
"""Speculative decoding beside plain decode on one workload: accept length and tokens/s.

Run on the CUDA machine (see scripts/device_prelude.sh)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks spec_decode --out "$OUT"

Serves ``configs/dsv32-small-spec.yaml`` (dsv32-small, the seed's setting: MTP draft, 3
draft steps, 4 tokens per verify) four times over one model and one workload, in this
order: plain decode, MTP speculation, n-gram speculation (4 tokens per verify), plain
decode again (both plain runs are reported: the first pays what the second does not).
Every run captures its CUDA graphs before its clock starts. For each run it records
tokens/s (all generated tokens over the wall time), decode tokens/s, decode step time
p50/p99, graph replays and eager fallbacks; for the speculative runs the mean accept
length (tokens a verify keeps per request), accepted tokens per verify step and draft
forwards by kind, and how many requests' tokens equal plain decoding's (bf16 on the GPU
is not batch-invariant: a verify row may round differently from a decode row, so this is
reported, not required; the CPU suite proves exact equality). Prints a table, writes
``spec_decode.json`` under ``--out``. ``--smoke`` runs the tiny preset on the CPU with a
few requests (tests/serving/test_speculative.py runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, machine, print_table
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.model_setup import build_model, model_config, resolve_device
from dsv32_engine.serving.report import summarize
from dsv32_engine.serving.run_config import RunConfig, load_run_config

GPU_STEPS = {
    "": "--out {out}",
}

RUNS = (
    ("plain", {"speculative.draft": "none"}),
    ("mtp", {}),
    ("ngram", {"speculative.draft": "ngram"}),
    ("plain again", {"speculative.draft": "none"}),
)
"""Run name -> overrides of the benchmark config (the config itself is the MTP run)."""


def _config(path: Path, base: dict[str, Any], extra: dict[str, Any]) -> RunConfig:
    return load_run_config(path, {**base, **extra, "speculative.compare_plain": False})


def run_one(config: RunConfig, model) -> tuple[dict[str, Any], dict[int, list[int]]]:
    engine = DecodeEngine(config, model=model)
    start = time.perf_counter()
    result = engine.run(progress=False, keep_tokens=True)
    s = summarize(engine, result)
    row = {
        "tokens_per_second": s["tokens_per_second"],
        "decode_tokens_per_second": s["decode_tokens_per_second"],
        "generated_tokens": s["generated_tokens"],
        "decode_steps": s["decode_steps"],
        "step_ms_p50": s["step_ms_p50"],
        "step_ms_p99": s["step_ms_p99"],
        "graph_replays": s["graph_replays"],
        "eager_fallbacks": s["eager_fallbacks"],
        "steps_by_mode": s["steps_by_mode"],
        "wall_seconds_with_capture": time.perf_counter() - start,
    }
    if s["speculative"]:
        row.update(s["speculative"])
        row["draft_eager_fallbacks"] = {
            mode.value: dict(r.stats.eager) for mode, r in engine.speculation.runners.items()
        }
    return row, result.tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "dsv32-small-spec.yaml")
    p.add_argument("--requests", type=int, default=None, help="override loop.requests")
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, few requests")
    args = p.parse_args(argv)
    base: dict[str, Any] = {}
    if args.smoke:
        base = {
            "device": "cpu",
            "model.preset": "tiny",
            "model.dtype": "float32",
            "planner.max_batch": 2,
            "planner.max_context": 128,
            "loop.prompt_len": [4, 16],
            "loop.max_new_tokens": [4, 10],
            "loop.chunk_tokens": 128,
            "loop.requests": 2,
            "graphs.sizes": [1, 2],
        }
    if args.requests is not None:
        base["loop.requests"] = args.requests
    first = _config(args.config, base, {})
    device = resolve_device(first.device)
    model = build_model(first, model_config(first.model), device)
    rows, tokens = {}, {}
    for name, extra in RUNS:
        rows[name], tokens[name] = run_one(_config(args.config, base, extra), model)
        gc.collect()  # the last engine's graphs, pools and KV cache go before the next's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: {rows[name]['tokens_per_second']:.1f} tokens/s", flush=True)
    plain = tokens["plain"]
    for name in rows:
        same = sum(tokens[name].get(rid) == want for rid, want in plain.items())
        rows[name]["requests_equal_to_plain"] = f"{same}/{len(plain)}"
    header = [
        "run",
        "tokens/s",
        "decode tok/s",
        "step p50 ms",
        "accept len",
        "acc/verify",
        "=plain",
    ]
    table = [
        [
            name,
            r["tokens_per_second"],
            r["decode_tokens_per_second"],
            r["step_ms_p50"],
            r.get("mean_accept_length", "-"),
            r.get("accepted_tokens_per_verify_step", "-"),
            r["requests_equal_to_plain"],
        ]
        for name, r in rows.items()
    ]
    text = print_table(f"speculative decoding, {first.model.preset} on {device}", header, table)
    report = {
        "machine": machine(),
        "config": str(args.config),
        "overrides": base,
        "runs": rows,
        "speedup_mtp_over_plain": rows["mtp"]["tokens_per_second"]
        / max(rows["plain again"]["tokens_per_second"], 1e-9),
        "table": text,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_decode.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
