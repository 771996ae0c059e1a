#!/usr/bin/env python3
"""Host overhead of one graph step: planner refresh + input copy + ``graph.replay()`` call.

A CUDA graph only pays off if the host work around it stays small next to the
GPU step. This measures, per batch size (1, 64, 256 by default), what the host
spends in each phase of ``GraphRunner.step`` (from the runner's own
``perf_counter`` split), the whole step with a device sync, and, for
contrast, an eager step (``planner.plan`` + the same forward). The forward is
deliberately tiny (one read of every plan field) so the numbers are host
overhead, not model time.

Run on the CUDA machine::

    python3 -m benchmarks replay_overhead --out "$OUT/replay_overhead.json" --plot "$OUT/replay_overhead.png"

``--device cpu`` runs the same loop on emulated graphs (a smoke test; the
numbers then mean little).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import backends  # noqa: F401  (registers the backends)
from graphs import GraphRunner, GraphWarning, PulledTransport
from planner import ForwardBatch, ForwardMode, Limits, Planner, PlanSet

GPU_STEPS = {
    "": "--iters 300 --batches 1 64 256 --out {out}/replay_overhead.json",
    "verify": "--iters 300 --batches 1 64 256 --mode target_verify --out {out}/replay_overhead_verify.json",
}

PHASES = ("refresh", "inputs", "replay")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--backends", nargs="+", default=["paged", "nsa"])
    p.add_argument("--mode", choices=[m.value for m in ForwardMode], default="decode")
    p.add_argument("--next-n", type=int, default=2, help="tokens per request in target_verify")
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--staging",
        nargs="+",
        choices=["slot", "graph", "copy"],
        default=["slot", "graph", "copy"],
        help="how a step's inputs reach the device: written by the engine into the planner's "
        "staging slot (Planner.step_inputs) and pulled by the graph, as the decode loop does; "
        "a ForwardBatch the planner writes into the slot, pulled by the graph; or the same "
        "sent by a copy before the launch. Several are interleaved step by step",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    return p.parse_args(argv)


def make_table(requests: int, max_context: int, page: int, device: torch.device) -> torch.Tensor:
    """req_to_token with whole pages per request; row 0 is the null request."""
    pages = -(-max_context // page)
    ids = torch.randperm((requests - 1) * pages, generator=torch.Generator().manual_seed(0)) + 1
    slots = (ids.view(requests - 1, pages, 1) * page + torch.arange(page)).view(requests - 1, -1)
    table = torch.zeros(requests, pages * page, dtype=torch.int32)
    table[1:] = slots.to(torch.int32)
    return table[:, :max_context].contiguous().to(device)


def make_batch(
    rng: random.Random, table: torch.Tensor, host: torch.Tensor, bs: int, mode: ForwardMode, n: int
) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
    """A random valid batch of ``bs`` distinct requests; lengths and slots on the host."""
    reqs = rng.sample(range(1, host.shape[0]), bs)
    lens = [rng.randint(n, host.shape[1]) for _ in reqs]
    cols = torch.tensor([[length - n + i for i in range(n)] for length in lens])
    pool = torch.tensor(reqs, dtype=torch.int64)
    batch = ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=pool,
        req_to_token=table,
        out_cache_loc=host[pool[:, None], cols].reshape(-1).to(torch.int64),
        mode=mode,
        next_n=n,
    )
    ids = torch.randint(0, 1000, (bs * n,), dtype=torch.int64)
    return batch, {"input_ids": ids.to(table.device)}  # sampled tokens live on the device


def engine_writes(planner: Planner, batch: ForwardBatch) -> ForwardBatch:
    """``batch`` written the way the decode loop's scheduler writes a step: straight into
    the planner's staging slot (numpy views), the batch handed on being views of it."""
    step = planner.step_inputs(ForwardMode(batch.mode))
    n, t = batch.bs, batch.out_cache_loc.shape[0]
    step.seq_lens[:n] = batch.seq_lens_cpu.numpy()
    step.extend_lens[:n] = batch.next_n
    step.req_pool_indices[:n] = batch.req_pool_indices.numpy()
    step.out_cache_loc[:t] = batch.out_cache_loc.numpy()
    step.set_counts(n, t, positions_given=False)
    return step.batch(batch.req_to_token, batch.next_n)


def light_forward(inputs: dict[str, torch.Tensor], plans: PlanSet) -> torch.Tensor:
    """Reads one element of every plan field: graph-safe, negligible GPU time."""
    acc = inputs["input_ids"].clone()
    for plan in plans.values():
        for tensor in plan.tensors().values():
            if tensor.numel():
                acc += tensor.reshape(-1)[:1].to(acc.dtype)
    return acc


def _us(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": 1e6 * statistics.median(ordered),
        "p99": 1e6 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "mean": 1e6 * statistics.fmean(ordered),
    }


def measure(
    args: argparse.Namespace,
    bs: int,
    batches: list,
    sync: Callable[[], None],
    runners: dict[str, GraphRunner],
) -> list[dict[str, Any]]:
    """Per-step phase times of graph steps, step+sync wall time, and eager host time, for
    each runner, their steps interleaved (the host's drift falls on all alike)."""
    names = list(runners)
    phases = {n: {k: [] for k in PHASES} for n in names}
    host = {n: [] for n in names}
    wall = {n: [] for n in names}
    eager: list[float] = []
    for i, (batch, inputs) in enumerate(batches):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            runner = runners[name]
            step_batch = batch
            if name == "slot":  # the engine's own writes, outside the timed step
                step_batch = engine_writes(runner.planner, batch)
            before = dict(runner.stats.host_seconds)
            sync()
            t0 = time.perf_counter()
            runner.step(step_batch, inputs)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if i < args.warmup:
                continue
            for k in PHASES:
                phases[name][k].append(runner.stats.host_seconds[k] - before.get(k, 0.0))
            host[name].append(t1 - t0)
            wall[name].append(t2 - t0)
    planner = runners[names[0]].planner
    for i, (batch, inputs) in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        plans = planner.plan(batch)
        light_forward(dict(inputs), plans)
        t1 = time.perf_counter()
        if i >= args.warmup:
            eager.append(t1 - t0)
    rows = []
    for name in names:
        size = runners[name].route(ForwardMode(args.mode), bs)[0]
        row = {"bs": bs, "staging": name, "graph_size": size}
        row.update({k: _us(v) for k, v in phases[name].items()})
        row.update(step_host=_us(host[name]), step_sync=_us(wall[name]), eager_host=_us(eager))
        rows.append(row)
    return rows


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    mode = ForwardMode(args.mode)
    n = args.next_n if mode is ForwardMode.TARGET_VERIFY else 1
    top = max(args.batches)
    limits = Limits(
        max_batch=top,
        max_context=args.max_context,
        page_size=args.page_size,
        next_n=args.next_n,
        device=str(device),
        kv_slots=(top + 1) * args.max_context,
    )
    table = make_table(top + 1, args.max_context, args.page_size, device)
    runners = {}
    for staging in dict.fromkeys(args.staging):
        transport = PulledTransport if staging in ("slot", "graph") else None
        planner = Planner(args.backends, limits, debug=False, transport=transport)
        runners[staging] = GraphRunner(
            planner,
            light_forward,
            req_to_token=table,
            static_inputs={"input_ids": torch.int64},
            modes=[mode],
            sizes=sorted(set(args.batches)),
        )
        stats = runners[staging].capture()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rng = random.Random(args.seed)
    host = table.cpu()
    rows = []
    for bs in args.batches:
        batches = [
            make_batch(rng, table, host, bs, mode, n) for _ in range(args.warmup + args.iters)
        ]
        rows.extend(measure(args, bs, batches, sync, runners))
    first = next(iter(runners.values()))
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
        "providers": first.planner.providers_chosen(mode),
        "graph_kind": stats.kind,
        "rows": rows,
        "graphs": {name: r.stats.summary() for name, r in runners.items()},
    }


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(
        title=f"Host overhead per step, us p50 (p99) - {result['graph_kind']} graphs, "
        f"{'+'.join(cfg['backends'])}, {cfg['mode']}, {result['device']}"
    )
    columns = ("bs", "staging", "refresh", "inputs", "replay call", "step host", "step + sync")
    for col in (*columns, "eager host"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        cells = [
            row[k] for k in ("refresh", "inputs", "replay", "step_host", "step_sync", "eager_host")
        ]
        table.add_row(
            str(row["bs"]),
            row.get("staging", "copy"),
            *(f"{c['p50']:.1f} ({c['p99']:.1f})" for c in cells),
        )
    Console().print(table)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['bs']}\n{r.get('staging', 'copy')}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for phase, name in zip(
        PHASES, ("planner refresh", "input copy", "graph.replay()"), strict=True
    ):
        values = [r[phase]["p50"] for r in rows]
        ax.bar([i - 0.2 for i in x], values, 0.4, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.bar(
        [i + 0.2 for i in x],
        [r["eager_host"]["p50"] for r in rows],
        0.4,
        label="eager plan + forward",
    )
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("batch size")
    ax.set_ylabel("host time per step, us (p50)")
    ax.set_title(f"Graph step host overhead ({result['graph_kind']}, {result['config']['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The measured rows and graphs, printed and written as the flags ask."""
    args = parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", GraphWarning
        )  # a dropped size or a fallback spoils the numbers
        result = measure_all(args)
    render(result)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.plot:
        plot(result, args.plot)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
