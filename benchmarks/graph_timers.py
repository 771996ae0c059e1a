"""Timers of benchmarks/bench_moe_topk.py: CUDA-graph replays on a GPU, eager calls on the CPU.

Both warm up first (compilation, allocation and autotuning stay out of the numbers)
and report the median and p99 of per-call times in microseconds; the graph timer
puts CUDA events around each replay, so host launch cost is not in it, as in serving.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


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
