#!/usr/bin/env python3
"""GPU soak: real CUDA graphs replay == eager over random batch sequences, and a long decode run.

Part A (``fuzz``): ``--sequences`` (1,000) random batch sequences through graph runners over
one planner of both the NSA (DeepSeek-V3.2) and the paged backend, each runner with a
random capture-size set, decode and target-verify. The captured forward reads every plan
field (an integer digest per row), so the planner's graph-safe ops are recorded in the
graph and run by ``graph.replay()``. After each replayed step the plans must be the
captured objects at their captured addresses, equal ``plan(batch, pad_to=size)`` bit for
bit, hold the pad values in padding rows, and the graph's digest must equal the digest of
the padded eager plan.

Part B (``decode``): at least ``--decode-steps`` (2,000) decode steps of dsv32-small through
``planner/serving/engine.py`` (CUDA graphs, deep_gemm when installed) with requests
arriving and finishing. After a warm-up it samples ``torch.cuda.memory_allocated`` /
``memory_reserved`` and host RSS; at the end every KV page is returned, no batch ran
eagerly, no capture was dropped.

Prints a table; ``--out`` writes JSON. Exit status 1 when a check fails. On the H200
(about 2-3 minutes)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks soak_gpu --out "$OUT/soak_gpu.json"

``--device cpu --config dsv32-tiny.yaml`` runs the same code on emulated graphs (a smoke
test with small ``--sequences`` / ``--decode-steps``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from backends.nsa import warmup_schedule_buckets
from benchmarks.common import ROOT, num_sms_of, sync
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.requests import make_workload
from dsv32_engine.serving.run_config import load_run_config
from graphs import GraphRunner, GraphWarning
from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from planner.debug import diff_plans, padding_violations
from planner.schema import parse_dim

GPU_STEPS = {
    "": "--out {out}/soak_gpu.json",
}

DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
PAGE, NEXT_N = 64, 2
MIB = 1 << 20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", nargs="+", choices=("fuzz", "decode"), default=["fuzz", "decode"])
    p.add_argument("--sequences", type=int, default=1000)
    p.add_argument("--runners", type=int, default=10, help="capture-size sets in part A")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="decode steps before memory sampling")
    p.add_argument("--every", type=int, default=100, help="decode steps between samples")
    p.add_argument("--config", default="dsv32-small.yaml", help="run config for part B")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[2, 8], metavar=("LO", "HI"))
    p.add_argument("--max-new-tokens", type=int, nargs=2, default=[32, 160], metavar=("LO", "HI"))
    p.add_argument("--max-allocated-growth-mib", type=float, default=1.0)
    p.add_argument("--max-reserved-growth-mib", type=float, default=64.0)
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


# ---- A. random batch sequences ------------------------------------------------------------
# Through real (or emulated) graphs. The captured forward reads every plan field (an integer
# digest per row), so the planner's graph-safe ops are recorded in the graph and run by
# ``graph.replay()``; after each replayed step the plans must be the captured objects at
# their captured addresses, equal ``plan(batch, pad_to=size)`` bit for bit, hold the pad
# values in padding rows, and the graph's digest must equal the padded eager plan's.


def make_table(rows: int, max_context: int) -> torch.Tensor:
    """req_to_token: row 0 the null request, the others own shuffled whole pages."""
    pages = -(-max_context // PAGE)
    ids = torch.randperm((rows - 1) * pages, generator=torch.Generator().manual_seed(7)) + 1
    slots = (ids.view(rows - 1, pages, 1) * PAGE + torch.arange(PAGE)).view(rows - 1, -1)
    table = torch.zeros(rows, pages * PAGE, dtype=torch.int32)
    table[1:] = slots.to(torch.int32)
    return table[:, :max_context].contiguous()


def random_batch(
    rng: random.Random, table: torch.Tensor, host: torch.Tensor, mode: ForwardMode, bs: int
) -> ForwardBatch:
    """Edge-biased lengths (page and 256-token split boundaries), int32 or int64 inputs."""
    n = NEXT_N if mode is VERIFY else 1
    width = host.shape[1]
    edges = [1, 2, 63, 64, 65, 255, 256, 257, width - 1, width]
    reqs = rng.sample(range(1, host.shape[0]), bs)
    lens = [
        max(n, rng.choice(edges)) if rng.random() < 0.3 else rng.randint(n, width) for _ in reqs
    ]
    cols = [[length - n + i for i in range(n)] for length in lens]
    locs = [int(host[r, c]) for r, row in zip(reqs, cols) for c in row]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=rng.choice([torch.int32, torch.int64]))

    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=index(reqs),
        req_to_token=table,
        out_cache_loc=index(locs),
        positions=index([c for row in cols for c in row]) if rng.random() < 0.5 else None,
        mode=mode,
        next_n=n,
    )


def digest_forward(inputs: dict[str, torch.Tensor], plans: PlanSet) -> dict[str, torch.Tensor]:
    """Per query row, an int64 function of every field of every plan (graph-safe)."""
    rows = inputs["input_ids"].shape[0]
    some = next(iter(plans.values()))
    device = inputs["input_ids"].device
    req = torch.arange(rows, device=device) // int(some.next_n)
    cols = []
    for plan in plans.values():
        for name, tensor in plan.tensors().items():
            dim, offset = parse_dim(plan.tensor_specs[name].shape[0])
            x = tensor.long()
            if dim not in ("reqs", "rows"):  # the schedule: one per batch
                cols.append(x.sum().expand(rows))
                continue
            if x.dim() == 2:
                x = x.sum(1) * 31 + (x > 0).sum(1)
            cols.append(x[req] if dim == "reqs" else x[:rows])
            if dim == "reqs" and offset == 1:  # offsets (reqs+1): each request's end too
                cols.append(x[req + 1])
    return {"digest": torch.stack(cols, dim=1), "ids": inputs["input_ids"] * 1}


def _pointers(plans: PlanSet) -> list[int]:
    return [t.data_ptr() for plan in plans.values() for t in plan.tensors().values()]


def _recording_capture(capture, captured):
    """Wrap ``planner.capture`` to keep each captured plan set and its tensors' addresses."""

    def wrapper(bs, mode=DECODE, **kw):
        plans = capture(bs, mode, **kw)
        captured[(ForwardMode(mode), bs)] = (plans, _pointers(plans))
        return plans

    return wrapper


def part_fuzz(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pool = 2 * args.max_batch + 1
    host = make_table(pool, args.max_context)
    table = host.to(device)
    slots = int(host.max()) + 1
    num_sms = num_sms_of(device)
    counts: Counter = Counter()
    failures: list[str] = []
    providers: dict[str, str] = {}
    start = time.perf_counter()
    per_runner = -(-args.sequences // args.runners)
    done = 0
    for r in range(args.runners):
        limits = Limits(
            max_batch=args.max_batch,
            max_context=args.max_context,
            page_size=PAGE,
            next_n=NEXT_N,
            num_sms=num_sms,
            kv_slots=slots,
            device=str(device),
        )
        planner = Planner(["nsa", "paged"], limits)
        providers = planner.providers_chosen()
        captured: dict[tuple[ForwardMode, int], tuple[PlanSet, list[int]]] = {}
        planner.capture = _recording_capture(planner.capture, captured)
        k = rng.randint(1, 6)
        sizes = sorted(rng.sample(range(1, args.max_batch + 1), k))
        if r == 0:
            sizes = sorted(set(sizes) | {args.max_batch})  # one runner covers every batch
        runner = GraphRunner(
            planner,
            digest_forward,
            req_to_token=table,
            static_inputs={"input_ids": torch.int64},
            sizes=sizes,
            warmup=lambda p, bs: warmup_schedule_buckets(
                p.limits.max_batch, p.limits.next_n, p.limits.num_sms, p.device
            ),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GraphWarning)
            runner.capture()
        caught = [w for w in caught if issubclass(w.category, GraphWarning)]
        counts["graphs"] += sum(len(v) for v in runner.stats.captured.values())
        counts["dropped"] += sum(len(v) for v in runner.stats.dropped.values())
        for _ in range(min(per_runner, args.sequences - done)):
            for _step in range(rng.randint(1, 6)):
                mode = rng.choice([DECODE, VERIFY])
                batch = random_batch(rng, table, host, mode, rng.randint(1, args.max_batch))
                n = batch.next_n
                rows = batch.bs * n
                ids = torch.randint(0, 1000, (rows,), dtype=torch.int64).to(device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", GraphWarning)
                    out = runner.step(batch, {"input_ids": ids})
                size, _ = runner.route(mode, batch.bs)
                if size is None:
                    counts["eager"] += 1
                    continue
                plans = runner.last_plans
                where = f"runner {r} sizes {sizes} {mode.value} bs={batch.bs} size={size}"
                problems = []
                plans0, pointers0 = captured[(mode, size)]
                if plans is not plans0 or _pointers(plans) != pointers0:
                    problems.append("plans moved or were replaced")
                eager = planner.plan(batch, pad_to=size)
                problems += [m.describe() for m in diff_plans(plans, eager)]
                program = planner.program(mode)
                real = {"reqs": batch.bs, "rows": rows}
                problems += [f"{k} padding" for k in padding_violations(plans, program.pads, real)]
                want = digest_forward(
                    {"input_ids": torch.zeros(size * n, dtype=torch.int64, device=device)}, eager
                )["digest"][:rows]
                if not torch.equal(out["digest"], want):
                    problems.append("graph digest != padded eager digest")
                if problems:
                    failures.append(f"{where}: " + "; ".join(problems[:3]))
                counts[f"replay/{mode.value}"] += 1
                counts[f"size/{size}"] += 1
            done += 1
        counts["warnings"] += len(caught)
        runner.close()
        del runner, planner, captured
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sync(device)
    replays = counts["replay/decode"] + counts["replay/target_verify"]
    return {
        "sequences": done,
        "runners": args.runners,
        "replays": replays,
        "replays_decode": counts["replay/decode"],
        "replays_verify": counts["replay/target_verify"],
        "eager_steps": counts["eager"],
        "graphs_captured": counts["graphs"],
        "captures_dropped": counts["dropped"],
        "capture_warnings": counts["warnings"],
        "distinct_sizes": sum(1 for k in counts if k.startswith("size/")),
        "mismatches": len(failures),
        "first_failures": failures[:5],
        "providers": providers,
        "seconds": time.perf_counter() - start,
        "ok": not failures and replays > 0 and counts["dropped"] == 0,
    }


# ---- B. a long decode run -----------------------------------------------------------------
# Through the engine, memory tracked: after a warm-up it samples
# ``torch.cuda.memory_allocated`` / ``memory_reserved`` and host RSS every few steps: growth
# there is a leak no short test sees. At the end every KV page must be returned, no batch run
# eagerly, no capture dropped.


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


# ---- output --------------------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    lines = [f"soak on {result['machine']['device_name']}"]
    fuzz = result.get("fuzz")
    if fuzz:
        lines += [
            "",
            "A. random batch sequences, replay == eager (nsa + paged)",
            f"  sequences {fuzz['sequences']} over {fuzz['runners']} capture-size sets, "
            f"{fuzz['graphs_captured']} graphs ({fuzz['captures_dropped']} dropped)",
            f"  replays {fuzz['replays']} (decode {fuzz['replays_decode']}, verify "
            f"{fuzz['replays_verify']}), eager {fuzz['eager_steps']}, sizes "
            f"{fuzz['distinct_sizes']}",
            f"  mismatches {fuzz['mismatches']}   {fuzz['seconds']:.1f} s   "
            f"{'PASS' if fuzz['ok'] else 'FAIL'}",
        ]
        lines += [f"  ! {f}" for f in fuzz["first_failures"]]
    dec = result.get("decode")
    if dec:
        lines += [
            "",
            f"B. decode soak ({dec['config']}, {dec['graph_kind']} graphs)",
            f"  {dec['decode_steps']} decode steps (+{dec['prefill_steps']} prefill), "
            f"{dec['requests']} requests, batch sizes seen {dec['batch_sizes']} "
            f"(largest {dec['largest_batch']}), {dec['wall_seconds']:.1f} s",
            f"  step p50 {dec['step_ms_p50']:.2f} ms, p99 {dec['step_ms_p99']:.2f} ms; graph "
            f"steps {dec['graph_steps']}, eager {dec['eager_fallbacks'] or 0}",
            f"  after warm-up: allocated {dec['allocated_mib_after_warmup']:.1f} MiB "
            f"(+{dec['allocated_growth_mib']:.2f}), reserved +{dec['reserved_growth_mib']:.2f} "
            f"MiB, RSS {dec['rss_mib_after_warmup']:.0f} MiB (+{dec['rss_growth_mib']:.2f})",
        ]
        for name, ok in dec["checks"].items():
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Both parts' results (``ok``: every check of the parts run passed)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    start = time.perf_counter()
    if "fuzz" in args.parts:
        result["fuzz"] = part_fuzz(args, device)
    if "decode" in args.parts:
        result["decode"] = part_decode(args, device)
    result["seconds"] = time.perf_counter() - start
    result["ok"] = all(result[p]["ok"] for p in args.parts)
    print(render(result))
    print(f"\ntotal {result['seconds']:.1f} s: {'PASS' if result['ok'] else 'FAIL'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
