"""The end-of-run summary: throughput, step-time percentiles, planner cost, graph hit rate."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table

from dsv32_engine.serving.run_config import RunConfig
from planner.batch import ForwardMode


def _percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _per(seconds: float, count: int, scale: float = 1.0) -> float:
    return scale * seconds / count if count else 0.0


def _steps(engine: Any, result: Any) -> Counter:
    """Forward steps by mode, the draft model's included."""
    steps = Counter(result.steps_by_mode)
    if getattr(engine, "speculation", None) is not None:
        steps.update(engine.speculation.stats.draft_forwards)
    return steps


def runners(engine: Any) -> list[Any]:
    """Every graph runner of the engine: the target's, and the draft's per draft mode."""
    spec = getattr(engine, "speculation", None)
    return [engine.runner, *(spec.runners.values() if spec is not None else [])]


def graph_replays(engine: Any) -> int:
    """Graph replays of every runner, the draft's included: what "graph replays" counts in
    the summary, a rank's line and the aggregate alike."""
    return sum(runner.stats.graph_steps for runner in runners(engine))


def debug_checks(engine: Any) -> dict[str, Any]:
    """What debug mode checked (``None`` counts without it: nothing was checked): replays
    compared bit for bit with eager, and forwards whose plans were digested for writes."""
    planner = engine.planner
    on = bool(planner.debug)
    return {
        "debug": on,
        "verified_replays": planner.stats.verified if on else None,
        "plan_write_checks": planner.stats.write_checks if on else None,
    }


def summarize(engine: Any, result: Any) -> dict[str, Any]:
    """Numbers a serving engineer asks for first, as a flat dict (also the ``--json`` output).

    Every count is of what ran: a loop cut short (``max_steps``, Ctrl-C: ``interrupted``)
    counts the tokens its unfinished requests had, and the loop's steps beside the forwards
    they ran (``steps_by_mode``: one loop step runs prompt chunks and decode rows as one
    forward or two, and a draft adds its own).
    """
    stats = engine.planner.stats
    graph = engine.runner.stats.summary()
    generated = result.generated_tokens
    decode_mode = engine.decode_mode
    decode_calls = stats.op_calls_per_batch(decode_mode)
    batches, host = stats.batches, stats.host_seconds
    eager_extend = batches["eager_extend"] + batches["eager_mixed"]
    return {
        "device": str(engine.device),
        "layers": engine.model_config.num_hidden_layers,
        "sparse_mla_kernel": engine.mla_kernel,
        "batch_invariant": engine.config.planner.batch_invariant,
        "staging": engine.planner.staging,
        "interrupted": result.interrupted,
        "loop_steps": result.loop_steps,
        "requests_finished": result.finished,
        "requests_unfinished": result.unfinished,
        "generated_tokens": generated,
        "wall_seconds": result.wall_seconds,
        "tokens_per_second": generated / result.wall_seconds if result.wall_seconds else 0.0,
        "prefill_tokens": result.prefill_tokens,
        "prefill_tokens_per_second": _per(result.prefill_tokens, 1) / result.prefill_seconds
        if result.prefill_seconds
        else 0.0,
        "decode_tokens": result.decode_tokens,
        "decode_tokens_per_second": result.decode_tokens / result.decode_seconds
        if result.decode_seconds
        else 0.0,
        "ttft_ms_p50": 1e3 * _percentile(result.ttft_seconds, 50),
        "ttft_ms_p99": 1e3 * _percentile(result.ttft_seconds, 99),
        "steps_by_mode": dict(sorted(_steps(engine, result).items())),
        "decode_steps": result.decode_steps,
        "prefill_steps": result.prefill_steps,
        "step_ms_p50": 1e3 * _percentile(result.step_seconds, 50),
        "step_ms_p99": 1e3 * _percentile(result.step_seconds, 99),
        "step_ms_mean": 1e3 * result.step_seconds.mean,
        "overlap": engine.overlap,
        "overlap_reason": engine.overlap_reason,
        "ragged_graphs": engine.config.ragged_graphs,
        "mixed": engine.config.mixes,
        "fast_paths_reason": _fast_paths_reason(engine.config),
        "loop_step_ms_p50": 1e3 * _percentile(result.loop_step_seconds, 50),
        "loop_step_ms_p99": 1e3 * _percentile(result.loop_step_seconds, 99),
        "gpu_busy": result.gpu_busy,
        "planner_us_per_replay": _per(host["replay"], batches["replay"], 1e6),
        "planner_us_per_eager_plan": _per(
            host[f"eager_{decode_mode.value}"], batches[f"eager_{decode_mode.value}"], 1e6
        ),
        "planner_us_per_extend_plan": _per(
            host["eager_extend"] + host["eager_mixed"], eager_extend, 1e6
        ),
        "planner_us_per_ragged_replay": graph["planner_us_per_ragged_replay"],
        "graph_pool_bytes": graph.get("pool_allocated_bytes"),
        "graph_pool_reserved_bytes": graph.get("pool_reserved_bytes"),
        "graph_capture_seconds": graph["capture_seconds"],
        "graph_capture_costs": graph["capture_costs"],
        "graph_replays": graph_replays(engine),
        "ragged_replays": graph["ragged_replays"],
        "eager_fallbacks": graph["eager_fallbacks"],
        "ragged_steps": graph["ragged_steps"],
        "graph_kind": graph["kind"],
        **debug_checks(engine),
        "speculative": engine.speculation.summary() if engine.speculation is not None else None,
        "op_calls_per_batch": {
            _program_name(key): stats.op_calls_per_batch(key)
            for key in stats.program_runs
            if stats.program_runs[key]
        },
        "schedule_calls_per_step": decode_calls.get("paged_mqa_schedule")
        if decode_calls and result.decode_steps
        else None,
        "static_bytes": graph["static_bytes"],
        "kv_tokens_capacity": (engine.cache.num_pages - 1) * engine.cache.page_size,
        "kv_cache_bytes": engine.cache.nbytes(),
    }


def render(summary: dict[str, Any], console: Console | None = None) -> None:
    """The summary as a table; a run cut short by Ctrl-C says so in the title."""
    console = console or Console()
    title = (
        f"DeepSeek-V3.2 decode ({summary['layers']} layers, {summary['device']}, "
        f"sparse MLA: {summary['sparse_mla_kernel']}"
        + (", batch-invariant)" if summary.get("batch_invariant") else ")")
    )
    if summary.get("interrupted"):
        title += f": INTERRUPTED (Ctrl-C) after {summary['loop_steps']} loop steps"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    schedule = summary["schedule_calls_per_step"]
    rows = [
        (
            "KV cache: tokens that fit (bytes)",
            f"{summary['kv_tokens_capacity']} ({summary['kv_cache_bytes'] / 2**30:.2f} GiB)",
        ),
        (
            "requests finished",
            f"{summary['requests_finished']}"
            + (
                f" ({summary['requests_unfinished']} unfinished)"
                if summary["requests_unfinished"]
                else ""
            ),
        ),
        ("generated tokens", f"{summary['generated_tokens']}"),
        ("tokens/s", f"{summary['tokens_per_second']:.1f}"),
        (
            "prefill tokens/s (prompt tokens)",
            f"{summary['prefill_tokens_per_second']:.1f} ({summary['prefill_tokens']})",
        ),
        (
            "decode tokens/s (generated in decode)",
            f"{summary['decode_tokens_per_second']:.1f} ({summary['decode_tokens']})",
        ),
        (
            "time to first token p50 / p99",
            f"{summary['ttft_ms_p50']:.1f} / {summary['ttft_ms_p99']:.1f} ms",
        ),
        (
            "loop steps (forwards by mode)",
            f"{summary['loop_steps']} ("
            + (", ".join(f"{k} {v}" for k, v in summary["steps_by_mode"].items()) or "none")
            + ")",
        ),
        (
            "decode step time p50 / p99",
            f"{summary['step_ms_p50']:.2f} / {summary['step_ms_p99']:.2f} ms",
        ),
        (
            "prompt chunks: under ragged graphs / mixed with decodes",
            f"{'yes' if summary['ragged_graphs'] else 'no'} / "
            f"{'yes' if summary['mixed'] else 'no'} ({summary['fast_paths_reason']})",
        ),
        (
            "loop: one step ahead / loop step p50 / p99",
            f"{'on' if summary['overlap'] else 'off'} ({summary['overlap_reason']}) / "
            f"{summary['loop_step_ms_p50']:.2f} / {summary['loop_step_ms_p99']:.2f} ms",
        ),
        *busy_rows(summary),
        (
            "planner host time per replay / eager decode / extend plan",
            f"{summary['planner_us_per_replay']:.0f} / "
            f"{summary['planner_us_per_eager_plan']:.0f} / "
            f"{summary['planner_us_per_extend_plan']:.0f} us",
        ),
        (
            f"graph replays ({summary['graph_kind']}): all / prompt chunks and mixed",
            f"{summary['graph_replays']} / {summary['ragged_replays']}",
        ),
        (
            "planner host time per ragged replay",
            f"{summary['planner_us_per_ragged_replay']:.0f} us"
            if summary["ragged_replays"]
            else "n/a (none replayed)",
        ),
        ("graph capture time (all graphs)", f"{summary['graph_capture_seconds']:.2f} s"),
        (
            "staged inputs reach the device by",
            "the graph's own pull"
            if summary["staging"] == "graph"
            else "a copy before each launch",
        ),
        (
            "eager fallbacks",
            "n/a (graphs off: every step eager, as asked)"
            if summary["graph_kind"] == "off"
            else ", ".join(f"{k}: {v}" for k, v in summary["eager_fallbacks"].items()) or "0",
        ),
        (
            "extend/mixed steps eager (ragged graphs off)",
            ", ".join(f"{k}: {v}" for k, v in summary["ragged_steps"].items()) or "0",
        ),
        (
            "schedule computations per step (decode, all layers)",
            "n/a (no decode step)" if schedule is None else f"{schedule:.2f}",
        ),
    ]
    if summary["debug"]:
        rows.append(
            (
                "debug checks: replays verified against eager / plan-write checks",
                f"{summary['verified_replays']} of {summary['graph_replays']} / "
                f"{summary['plan_write_checks']}",
            )
        )
    for mode, calls in summary["op_calls_per_batch"].items():
        rows.append((f"ops per {mode} batch", ", ".join(f"{k} {v:.0f}" for k, v in calls.items())))
    rows += speculative_rows(summary)
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def busy_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The GPU-busy row, where ``--gpu-busy`` profiled a window."""
    busy = summary.get("gpu_busy")
    if not busy:
        return []
    fraction = busy["fraction"]
    pace = busy["pace_ms_per_step"]
    return [
        (
            f"GPU busy ({busy['window_steps']} profiled loop steps): device time / unprofiled pace",
            ("n/a" if fraction is None else f"{100 * fraction:.1f}%")
            + f" ({busy['device_ms_per_step']:.3f} / "
            + ("n/a" if pace is None else f"{pace:.3f}")
            + " ms a step)",
        )
    ]


def speculative_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The speculative run's rows, and the plain run's beside them when there was one."""
    spec = summary.get("speculative")
    if not spec:
        return []
    rows = [
        (
            "speculative draft (tokens per verify)",
            f"{spec['draft']} ({spec['draft_tokens']})",
        ),
        ("mean accept length", f"{spec['mean_accept_length']:.2f}"),
        ("accepted tokens per verify step", f"{spec['accepted_tokens_per_verify_step']:.2f}"),
        (
            "verify steps (mixed with prompt chunks)",
            f"{spec['verify_steps']} ({spec['mixed_verify_steps']})",
        ),
    ]
    plain = summary.get("plain")
    if plain:
        rows += [
            (
                "tokens/s with / without speculation",
                f"{summary['tokens_per_second']:.1f} / {plain['tokens_per_second']:.1f}",
            ),
            (
                "decode tokens/s with / without speculation",
                f"{summary['decode_tokens_per_second']:.1f} / "
                f"{plain['decode_tokens_per_second']:.1f}",
            ),
            (
                "tokens equal to plain greedy decoding",
                "n/a (the plain run was interrupted)"
                if plain.get("tokens_equal") is None
                else "yes"
                if plain["tokens_equal"]
                else "NO",
            ),
        ]
    return rows


def _program_name(key: ForwardMode | tuple[ForwardMode, ForwardMode]) -> str:
    """A mode's name, or an idle batch of another shape's: ``idle:target_verify``."""
    return key.value if isinstance(key, ForwardMode) else ":".join(m.value for m in key)


def _fast_paths_reason(config: RunConfig) -> str:
    """Why prompt chunks do or do not replay ragged graphs and mix (for the summary)."""
    auto = [
        key
        for key, value in (
            ("graphs.ragged", config.graphs.ragged),
            ("loop.mixed", config.loop.mixed),
        )
        if value == "auto"
    ]
    if len(auto) == 2:
        return "auto: on where graphs run on CUDA"
    return "as set" if not auto else f"{auto[0]} auto: on where graphs run on CUDA"
