"""Part A of benchmarks/soak_gpu.py: random batch sequences through real (or emulated) graphs.

The captured forward reads every plan field (an integer digest per row), so the
planner's graph-safe ops are recorded in the graph and run by ``graph.replay()``; after
each replayed step the plans must be the captured objects at their captured
addresses, equal ``plan(batch, pad_to=size)`` bit for bit, hold the pad values in
padding rows, and the graph's digest must equal the padded eager plan's.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import warnings
from collections import Counter
from typing import Any

import torch

from backends.nsa import warmup_schedule_buckets
from benchmarks.common import num_sms_of, sync
from graphs import GraphRunner, GraphWarning
from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet
from planner.debug import diff_plans, padding_violations
from planner.schema import parse_dim

DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
PAGE, NEXT_N = 64, 2


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
