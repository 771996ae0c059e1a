"""Part B of benchmarks/soak_gpu.py: a long decode run through the engine, memory tracked.

After a warm-up it samples ``torch.cuda.memory_allocated`` / ``memory_reserved`` and
host RSS every few steps: growth there is a leak no short test sees. At the end every
KV page must be returned, no batch run eagerly, no capture dropped.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import warnings
from collections import Counter
from typing import Any

import torch

from benchmarks.common import ROOT, sync
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.requests import make_workload
from dsv32_engine.serving.run_config import load_run_config
from graphs import GraphWarning

MIB = 1 << 20


def rss_bytes() -> int:
    """This process's resident memory (Linux ``/proc``): host-side growth is a leak too."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def requests_for(config, steps: int) -> int:
    """The fewest requests whose seeded arrivals span ``steps`` loop steps."""

    def spans(requests: int) -> bool:
        loop = config.loop.model_copy(update={"requests": requests})
        return make_workload(loop, 2)[-1].arrival_step >= steps

    hi = 1
    while not spans(hi):
        hi *= 2
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if spans(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def part_decode(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    overrides = {
        "device": str(device),
        "loop.arrival_rate": 0.3,
        "loop.prompt_len": list(args.prompt_len),
        "loop.max_new_tokens": list(args.max_new_tokens),
        "loop.seed": args.seed,
        "planner.max_batch": args.max_batch,
    }
    path = ROOT / "configs" / args.config
    config = load_run_config(path, overrides)
    overrides["loop.requests"] = requests_for(config, args.decode_steps)
    engine = DecodeEngine(load_run_config(path, overrides))
    samples: list[dict[str, float]] = []
    sizes: Counter = Counter()
    inner = engine._decode_step

    def decode_step(requests, result):
        sizes[len(requests)] += 1
        accepted = inner(requests, result)
        n = sum(sizes.values())
        if n >= args.warmup and (n - args.warmup) % args.every == 0:
            sync(device)
            samples.append(
                {
                    "step": n,
                    "allocated": torch.cuda.memory_allocated(device)
                    if device.type == "cuda"
                    else 0,
                    "reserved": torch.cuda.memory_reserved(device) if device.type == "cuda" else 0,
                    "rss": rss_bytes(),
                }
            )
        return accepted

    engine._decode_step = decode_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False)
    caught = [w for w in caught if issubclass(w.category, GraphWarning)]
    sync(device)
    gc.collect()
    samples.append(
        {
            "step": result.decode_steps,
            "allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
            "reserved": torch.cuda.memory_reserved(device) if device.type == "cuda" else 0,
            "rss": rss_bytes(),
        }
    )
    first = samples[0]

    def growth(key: str) -> float:
        return (max(s[key] for s in samples) - first[key]) / MIB

    stats = engine.runner.stats
    times = sorted(result.step_seconds)
    report = {
        "config": args.config,
        "requests": result.finished,
        "decode_steps": result.decode_steps,
        "prefill_steps": result.prefill_steps,
        "batch_sizes": len(sizes),
        "largest_batch": max(sizes) if sizes else 0,
        "step_ms_p50": 1e3 * statistics.median(times),
        "step_ms_p99": 1e3 * times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        "graph_kind": stats.kind,
        "graph_steps": stats.graph_steps,
        "eager_fallbacks": dict(stats.eager),
        "dropped": {m: list(d) for m, d in stats.dropped.items()},
        "graph_warnings": [str(w.message) for w in caught],
        "used_pages_at_end": engine.cache.num_used_pages,
        "free_request_rows": engine.pool.num_free,
        "allocated_mib_after_warmup": first["allocated"] / MIB,
        "allocated_growth_mib": growth("allocated"),
        "reserved_growth_mib": growth("reserved"),
        "rss_mib_after_warmup": first["rss"] / MIB,
        "rss_growth_mib": growth("rss"),
        "samples": samples,
        "providers": engine.planner.providers_chosen(),
        "wall_seconds": result.wall_seconds,
    }
    report["checks"] = {
        "steps": result.decode_steps >= args.decode_steps,
        "all_finished": result.finished == engine.config.loop.requests,
        "pages_returned": engine.cache.num_used_pages == 0
        and engine.pool.num_free == engine.pool.pool_size - 1,
        "no_eager_fallback": not stats.eager and not stats.dropped and not caught,
        "allocated_flat": report["allocated_growth_mib"] <= args.max_allocated_growth_mib,
        "reserved_flat": report["reserved_growth_mib"] <= args.max_reserved_growth_mib,
        "rss_flat": report["rss_growth_mib"] <= args.max_rss_growth_mib,
    }
    report["ok"] = all(report["checks"].values())
    return report
