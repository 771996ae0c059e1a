"""Shared pieces of the benchmarks: timing with warm-up and medians, tables, plots, run metadata.

The one module the benchmarks share: host and device-synchronised timers (``time_calls``,
``time_host``, ``time_paired``), CUDA-graph replay and eager kernel timers (``time_graph``,
``time_eager``), cProfile summaries, the machine's description, fixed-width tables, JSON and
bar plots.
"""

from __future__ import annotations

import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def num_sms_of(device: torch.device, cpu: int = 132) -> int:
    """The device's SM count; ``cpu`` (an H200's 132 by default) off CUDA, so smoke runs
    plan like the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model step's outputs (the engine's forward returns a dict of outputs
    where the model has more than one, the tensor itself where not)."""
    return out["logits"] if isinstance(out, dict) else out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[int], Any], device: torch.device, *, warmup: int, iters: int
) -> dict[str, float]:
    """Wall time of ``fn(i)`` including a device sync: median, p10, p90 in milliseconds.

    Synchronising after each call charges the step with everything it made
    the GPU do and everything the host did to launch it, which is what a
    serving step costs.
    """
    for i in range(warmup):
        fn(i)
    sync(device)
    samples = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i)
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p10_ms": samples[len(samples) // 10],
        "p90_ms": samples[(len(samples) * 9) // 10],
        "p99_ms": samples[min(len(samples) - 1, (len(samples) * 99) // 100)],
        "iters": iters,
    }


def time_host(fn: Callable[[int], Any], *, warmup: int, iters: int) -> dict[str, float]:
    """Host time of ``fn(i)`` (no device sync): median, p10, p90 in microseconds."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(len(samples) * 9) // 10],
        "p99_us": samples[min(len(samples) - 1, (len(samples) * 99) // 100)],
        "iters": iters,
    }


def cprofile_top(fn: Callable[[int], Any], iters: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by self time over ``iters`` calls of ``fn(i)``, per call (cProfile):
    the calls nobody named, and a blocking call (a hidden synchronisation) as a large self time.
    cProfile's own cost per Python call inflates many small calls alike."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(iters):
        fn(i)
    prof.disable()
    return cprofile_rows(prof, iters, top)


def cprofile_rows(prof: cProfile.Profile, iters: int, top: int) -> list[dict[str, Any]]:
    """A finished profile's ``top`` functions by self time, per one of ``iters`` calls."""
    rows = [
        {
            "function": f"{path.split('/')[-1]}:{line}({name})",
            "calls_per_iter": nc / iters,
            "self_us": 1e6 * tt / iters,
            "total_us": 1e6 * ct / iters,
        }
        for (path, line, name), (_cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]
    rows.sort(key=lambda r: -r["self_us"])
    return rows[:top]


def time_paired(
    variants: Mapping[str, Callable[[int], Any]],
    *,
    warmup: int,
    iters: int,
    ratios_to: Sequence[str] = (),
    between: Callable[[], Any] | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`time_host` of several variants of one step, interleaved call by call (each
    round in a shuffled order), so the host's drift, which on the GPU hosts moves medians by 2x between
    blocks of calls, falls on every variant alike. Each variant's statistics, plus
    ``ratio_to_first``: the median over iterations of its time over the first variant's, and
    ``ratio_to <name>`` the same over each variant named in ``ratios_to``. ``between()`` runs
    untimed before every timed call (what a serving loop does between two of them)."""
    names = list(variants)
    for i in range(warmup):
        for name in names:
            variants[name](i)
    samples: dict[str, list[float]] = {name: [] for name in names}
    order, shuffle = list(names), random.Random(0).shuffle
    for i in range(iters):
        # a new order each call (seeded), so no variant always runs first, after whatever
        # evicted the caches, or always right after the same other one
        shuffle(order)
        for name in order:
            if between is not None:
                between()
            start = time.perf_counter()
            variants[name](i)
            samples[name].append((time.perf_counter() - start) * 1e6)
    out = {}
    for name in names:
        ratios = _median_ratio(samples[names[0]], samples[name])
        ordered = sorted(samples[name])
        out[name] = {
            "median_us": statistics.median(ordered),
            "p10_us": ordered[len(ordered) // 10],
            "p90_us": ordered[(len(ordered) * 9) // 10],
            "p99_us": ordered[min(len(ordered) - 1, (len(ordered) * 99) // 100)],
            "iters": iters,
            "ratio_to_first": ratios,
            **{f"ratio_to {ref}": _median_ratio(samples[ref], samples[name]) for ref in ratios_to},
        }
    return out


def _median_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """The median over calls of ``other``'s time over ``base``'s in the same round."""
    ratios = sorted(b / a for a, b in zip(base, other) if a > 0)
    return statistics.median(ratios) if ratios else float("nan")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
    return info


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (printed and returned), readable in any log."""
    cells = [[str(c) for c in header]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(cells[0], widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))


def plot_bars(
    path: str | None, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str
) -> None:
    """Grouped bars (one group per configuration, one bar per variant) as a PNG."""
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) + 2), 4))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(groups))], values, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- kernel timers
# CUDA-graph replays on a GPU, eager calls on the CPU. Both warm up first (compilation,
# allocation and autotuning stay out of the numbers) and report the median and p99 of
# per-call times in microseconds; the graph timer puts CUDA events around each replay, so
# host launch cost is not in it, as in serving.


def time_graph(
    fn: Callable[[], Any], *, warmup: int, iters: int, reps: int = 1
) -> dict[str, float]:
    """Capture ``fn`` ``reps`` times back to back in one graph, replay it; CUDA-event
    microseconds per call (each replay's time over ``reps``).

    ``reps=1`` charges each call with a whole graph launch (~10 us on the H200, more than
    a small kernel); a chain of calls (a decode step's layers) spreads that, which is
    closer to what one launch costs inside the decode step's graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(warmup):
        graph.replay()
    marks = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return _stats([s.elapsed_time(e) * 1e3 / reps for s, e in marks])


def time_eager(fn: Callable[[], Any], *, warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _stats(samples)


def _stats(samples: list[float]) -> dict[str, float]:
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p99_us": samples[min(len(samples) - 1, (len(samples) * 99) // 100)],
    }
