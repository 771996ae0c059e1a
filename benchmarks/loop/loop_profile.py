#!/usr/bin/env python3
"""Where the decode loop's host time goes, in steady state: a profile of a window of loop steps.

Why: with the loop one step ahead the GPU waits only while the host's work per step is longer
than the device's, so what that work is made of decides the next design step. A profile of
a whole run is dominated by start-up (weights, capture, compiles); this one profiles only
loop steps ``--start`` to ``--start + --steps - 1`` of a long decode (every request decoding
``--new`` tokens), so each row is a steady step's share. Two tools, one process each
(each distorts the other):

- ``cprofile``: the Python functions, by self time and inclusive time, in us per loop step;
- ``torch``: torch.profiler with CPU activity (and CUDA's where there is one): the torch ops
  and CUDA runtime calls the host makes per step (launches, copies, pinned allocations);
- ``none``: no profiler, the wall time of the same window (the pace the others distort).

``--trace PATH`` also writes the torch tool's window as a Chrome trace and reads it back:
per step, the device's kernels inside the graph and launched beside it, their time, and the
gaps between them, inside a graph (its own inter-kernel latency) or between launches.

    python3 -m benchmarks loop_profile --out $OUT/loop_profile.json
    python3 -m benchmarks loop_profile --config dsv32-tiny --requests 8 --new 200 --steps 100
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import time
from typing import Any

import torch
import yaml

from benchmarks.common import cprofile_rows, machine, print_table, write_json
from dsv32_engine.serving.engine import DecodeEngine
from dsv32_engine.serving.run_config import load_run_config

GPU_STEPS = {
    "": "--out {out}/loop_profile.json",
}

TOOLS = ("none", "cprofile", "torch")


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""The Chrome trace's categories of work that keeps the device busy (kineto's names)."""


def device_gaps(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per loop step, what the device ran and where it idled, from a Chrome trace's events.

    Each kernel, copy or fill is *in a graph* when it shares its correlation id with a
    ``cudaGraphLaunch`` (the launch that ran it), else *beside* it (launched on its own).
    The idle time between two consecutive pieces of device work is counted under
    ``in_graph`` when both belong to one graph launch (the graph's own inter-kernel
    latency, which no host work changes), else under ``between`` (the device waited for a
    launch or a copy). Overlapping work (several streams) leaves no gap."""
    launches = {
        e["args"].get("correlation")
        for e in events
        if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch"
    }
    work = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
        key=lambda e: e["ts"],
    )
    if not work:
        return {"device_ops_per_step": 0.0}
    graphed = [e["args"].get("correlation") in launches for e in work]
    gaps = {"in_graph": [0, 0.0], "between": [0, 0.0]}
    reach = work[0]["ts"] + work[0]["dur"]
    for before, after in zip(work, work[1:]):
        gap = after["ts"] - reach
        reach = max(reach, after["ts"] + after["dur"])
        if gap <= 0:
            continue
        same = before["args"].get("correlation") == after["args"].get("correlation")
        key = "in_graph" if same and before["args"].get("correlation") in launches else "between"
        gaps[key][0] += 1
        gaps[key][1] += gap
    return {
        "device_ops_per_step": len(work) / steps,
        "in_graph_ops_per_step": sum(graphed) / steps,
        "beside_ops_per_step": (len(work) - sum(graphed)) / steps,
        "device_us_per_step": sum(e["dur"] for e in work) / steps,
        "graph_gaps_per_step": gaps["in_graph"][0] / steps,
        "graph_gap_us_per_step": gaps["in_graph"][1] / steps,
        "other_gaps_per_step": gaps["between"][0] / steps,
        "other_gap_us_per_step": gaps["between"][1] / steps,
    }


class WindowProfile:
    """The engine's loop hook (``DecodeEngine.run(busy=...)``): profiles steps ``start`` to
    ``start + steps - 1`` with ``tool`` and keeps every loop step's wall time."""

    def __init__(
        self, tool: str, start: int, steps: int, device: torch.device, trace: str | None = None
    ) -> None:
        self.tool, self.start, self.steps, self.device = tool, start, steps, device
        self.trace = trace
        self.gaps: dict[str, Any] | None = None
        """With a trace: :func:`device_gaps` of the window."""
        self.seconds: dict[int, float] = {}
        self._profiler: Any = None
        self.window_wall = 0.0
        self._opened = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def at_step(self, step: int) -> None:
        if step == self.start:
            self._sync()
            if self.tool == "cprofile":
                self._profiler = cProfile.Profile()
                self._profiler.enable()
            elif self.tool == "torch":
                activities = [torch.profiler.ProfilerActivity.CPU]
                if self.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=activities)
                self._profiler.start()
            self._opened = time.perf_counter()
        elif step == self.start + self.steps:
            self._close()

    def _close(self) -> None:
        if self._opened and not self.window_wall:
            self._sync()
            self.window_wall = time.perf_counter() - self._opened
            if self.tool == "cprofile":
                self._profiler.disable()
            elif self.tool == "torch":
                self._profiler.stop()
                if self.trace:
                    self._profiler.export_chrome_trace(self.trace)
                    with open(self.trace, encoding="utf-8") as stream:
                        self.gaps = device_gaps(json.load(stream)["traceEvents"], self.steps)

    def loop_step(self, step: int, seconds: float) -> None:
        self.seconds[step] = seconds

    def finish(self, step: int) -> None:
        self._close()

    def summary(self) -> dict[str, Any]:
        window = [self.seconds[s] for s in range(self.start, self.start + self.steps)]
        out: dict[str, Any] = {
            "window_ms_per_step": 1e3 * self.window_wall / self.steps,
            "loop_step_ms_p50": 1e3 * statistics.median(window),
        }
        if self.tool == "cprofile":
            rows = cprofile_rows(self._profiler, self.steps, 10_000)
            out["self"] = rows[:40]
            out["inclusive"] = sorted(rows, key=lambda r: -r["total_us"])[:60]
        elif self.tool == "torch":
            averages = self._profiler.key_averages()
            out["table"] = averages.table(sort_by="self_cpu_time_total", row_limit=40)
            out["device_gaps"] = self.gaps
            out["ops"] = sorted(
                (
                    {
                        "name": e.key,
                        "calls_per_step": e.count / self.steps,
                        "self_cpu_us_per_step": e.self_cpu_time_total / self.steps,
                    }
                    for e in averages
                ),
                key=lambda r: -r["self_cpu_us_per_step"],
            )[:60]
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="steady-state profile of the decode loop's host time")
    p.add_argument("--config", default="dsv32-small", help="a shipped config or a YAML path")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new", type=int, default=600, help="tokens each request decodes")
    p.add_argument("--start", type=int, default=100, help="first profiled loop step")
    p.add_argument("--steps", type=int, default=300, help="loop steps profiled")
    p.add_argument("--tool", choices=TOOLS, action="append", help="default: all three")
    p.add_argument("--overlap", choices=("auto", "true", "false"), default="auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", help="the torch tool's window as a Chrome trace (JSON)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {
        "loop.requests": args.requests,
        "loop.max_new_tokens": [args.new, args.new],
        "loop.overlap": {"auto": "auto", "true": True, "false": False}[args.overlap],
    }
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)  # as the decode command reads --set
    results = {}
    for tool in args.tool or TOOLS:
        config = load_run_config(args.config, overrides)
        engine = DecodeEngine(config)
        hook = WindowProfile(tool, args.start, args.steps, engine.device, args.trace)
        result = engine.run(progress=False, busy=hook)
        results[tool] = hook.summary() | {
            "tokens_per_second": result.generated_tokens / result.wall_seconds
        }
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(
        f"{args.config}, {args.requests} requests, loop steps {args.start}-"
        f"{args.start + args.steps - 1}",
        ("profiler", "window ms/step", "loop step p50 ms"),
        [(t, r["window_ms_per_step"], r["loop_step_ms_p50"]) for t, r in results.items()],
    )
    if "cprofile" in results:
        for key in ("self", "inclusive"):
            print(f"\ncProfile, by {key} time (us per loop step)")
            for row in results["cprofile"][key][: args.top]:
                print(
                    f"  {row['self_us']:8.1f} self {row['total_us']:8.1f} total "
                    f"{row['calls_per_iter']:6.1f}x  {row['function']}"
                )
    if "torch" in results:
        print("\ntorch.profiler, by self CPU time (whole window)")
        print(results["torch"]["table"])
        gaps = results["torch"]["device_gaps"]
        if gaps:
            print_table(
                "the device per loop step (from the trace, under the profiler)",
                ("measure", "value"),
                [(k, f"{v:.1f}") for k, v in gaps.items()],
            )
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
