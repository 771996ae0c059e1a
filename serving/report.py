"""The end-of-run summary: throughput, step-time percentiles, planner cost, graph hit rate."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(engine: Any, result: Any) -> dict[str, Any]:
    """Numbers a serving engineer asks for first, as a flat dict (also the ``--json`` output)."""
    planner_stats = engine.planner.stats
    graph = engine.runner.stats.summary()
    generated = sum(len(t) for t in result.tokens.values())
    batches = planner_stats.batches["replay"] + planner_stats.batches["eager"]
    per_step_calls = (
        {op: n / batches for op, n in sorted(planner_stats.op_calls.items())} if batches else {}
    )
    replays, eagers = planner_stats.batches["replay"], planner_stats.batches["eager"]
    steps = result.decode_steps
    return {
        "device": str(engine.device),
        "layers": engine.model_config.num_hidden_layers,
        "requests_finished": len(result.tokens),
        "generated_tokens": generated,
        "wall_seconds": result.wall_seconds,
        "tokens_per_second": generated / result.wall_seconds if result.wall_seconds else 0.0,
        "decode_steps": steps,
        "prefill_steps": result.prefill_steps,
        "step_ms_p50": 1e3 * _percentile(result.step_seconds, 50),
        "step_ms_p99": 1e3 * _percentile(result.step_seconds, 99),
        "step_ms_mean": 1e3 * statistics.fmean(result.step_seconds) if result.step_seconds else 0.0,
        "planner_us_per_replay": 1e6 * planner_stats.host_seconds["replay"] / replays
        if replays
        else 0.0,
        "planner_us_per_eager_plan": 1e6 * planner_stats.host_seconds["eager"] / eagers
        if eagers
        else 0.0,
        "graph_pool_bytes": graph.get("pool_allocated_bytes"),
        "graph_replays": graph["graph_steps"],
        "eager_fallbacks": graph["eager_fallbacks"],
        "graph_kind": graph["kind"],
        "accepted_drafts": result.accepted_drafts,
        "op_calls_per_batch": per_step_calls,
        "schedule_calls_per_step": per_step_calls.get("paged_mqa_schedule", 0.0),
        "static_bytes": graph["static_bytes"],
    }


def render(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"DeepSeek-V3.2 decode ({summary['layers']} layers, {summary['device']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests finished", f"{summary['requests_finished']}"),
        ("generated tokens", f"{summary['generated_tokens']}"),
        ("tokens/s", f"{summary['tokens_per_second']:.1f}"),
        (
            "decode steps (+ eager prefill steps)",
            f"{summary['decode_steps']} (+{summary['prefill_steps']})",
        ),
        ("step time p50 / p99", f"{summary['step_ms_p50']:.2f} / {summary['step_ms_p99']:.2f} ms"),
        (
            "planner host time per replay / eager plan",
            f"{summary['planner_us_per_replay']:.0f} / {summary['planner_us_per_eager_plan']:.0f} us",
        ),
        (f"graph replays ({summary['graph_kind']})", f"{summary['graph_replays']}"),
        (
            "eager fallbacks",
            ", ".join(f"{k}: {v}" for k, v in summary["eager_fallbacks"].items()) or "0",
        ),
        (
            "schedule computations per step (all layers)",
            f"{summary['schedule_calls_per_step']:.2f}",
        ),
        (
            "ops per batch",
            ", ".join(f"{k} {v:.0f}" for k, v in summary["op_calls_per_batch"].items()),
        ),
    ]
    if summary["accepted_drafts"]:
        rows.append(("accepted drafts (next_n=2)", f"{summary['accepted_drafts']}"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
