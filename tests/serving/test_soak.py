"""Soak: DeepSeek-V3.2 tiny decode through the engine for thousands of steps, memory flat.

``dsv32_engine/serving/engine.py`` serves a Poisson workload (requests arrive and finish, so
batch sizes wander over 1..max_batch) through the planner and the emulated graph runner.
A probe wrapped around each decode step, after a warm-up:

- samples host RSS (``/proc/self/status`` ``VmRSS``, after ``gc.collect()`` and glibc's
  ``malloc_trim``), which sees tensors too: they live outside Python's allocator;
- then starts ``tracemalloc`` (its own memory would blur the RSS, hence the two
  windows), so whatever it still holds at the end was allocated later and never freed.
  The loop keeps nothing per finished request (the scheduler counts them, the run
  result counts requests and tokens; tokens only on ``run(keep_tokens=True)``), so what
  ``dsv32_engine/serving/`` may still hold is the run's bounded timings (``dsv32_engine/serving/samples.py``: 8
  bytes per decode step and per request, the latest 65,536 of each) and the last batch
  each graph size saw; anything held elsewhere beyond 64 KiB (planner, graphs, backends,
  models, torch; numpy's small-buffer cache and the last steps' tensor wrappers are a
  few KiB) is a leak. RSS growth in the first window must stay under 1 MiB.

At the end every KV page and request row is back in its free list, the token table is
all zeros, no batch fell back to eager (no ``GraphWarning``), and each op ran once per
batch.

Default suite: ~350 decode steps. ``pytest -m slow tests/serving/test_soak.py``: 10,000.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import time
import tracemalloc
import warnings
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from dsv32_engine.serving.engine import DecodeEngine
from graphs import GraphWarning
from tests.support import REPO
from tests.support.engines import tiny_engine

SERVING = str(REPO / "serving") + os.sep
"""Where the run's own record lives (the application package); allocations elsewhere are leaks."""
DECODE_STEPS_PER_REQUEST = 3.7
"""Decode steps the workload below yields per request (measured; the workload is seeded)."""


def workload(decode_steps: int, seed: int = 0, layers: int | None = None) -> dict:
    """Run-config overrides for a workload of about ``decode_steps`` decode steps.

    About 0.22 arrivals per step, each staying ~25 steps: ~5 requests running
    on average, so batches of every size from 1 to 8 occur and the graph
    runner replays its whole ladder. ``layers`` trims the tiny model (the
    forward is most of a CPU step; planner, runner and scheduler are the same).
    """
    overrides = {"model.overrides": {"num_hidden_layers": layers}} if layers else {}
    return overrides | {
        "loop.requests": int(decode_steps / DECODE_STEPS_PER_REQUEST) + 8,
        "loop.arrival_rate": 0.22,
        "loop.prompt_len": [2, 6],
        "loop.max_new_tokens": [4, 40],
        "loop.seed": seed,
        "planner.max_batch": 8,
        "planner.max_context": 128,
    }


def _malloc_trim() -> None:
    """Hand the C heap's free pages back to the OS (glibc), so RSS counts live memory only."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: free pages stay counted
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_bytes(*, trim: bool = False) -> int:
    """Resident set size of this process (after ``malloc_trim`` when ``trim``)."""
    if trim:
        gc.collect()
        _malloc_trim()
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class SoakReport:
    decode_steps: int = 0
    prefill_steps: int = 0
    finished: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    rss: list[tuple[int, int]] = field(default_factory=list)
    """(decode step, RSS) over the RSS window: warm-up end to the start of tracing."""
    finished_in_rss_window: int = 0
    leaked_bytes: int = 0
    """tracemalloc growth in the traced window outside dsv32_engine/serving/."""
    leaked_top: list[str] = field(default_factory=list)
    record_bytes: int = 0
    """tracemalloc growth in the traced window inside dsv32_engine/serving/ (the run's bounded timings)."""
    record_top: list[str] = field(default_factory=list)
    finished_in_traced_window: int = 0
    steps_in_traced_window: int = 0
    eager: dict = field(default_factory=dict)
    graph_warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rss_growth(self) -> int:
        """Largest RSS sample of the window minus the first."""
        values = [b for _, b in self.rss]
        return max(values) - values[0] if values else 0

    @property
    def record_bound(self) -> int:
        """What dsv32_engine/serving/ may hold of what the traced window allocated: the two timing arrays
        (8 bytes per decode step and per finished request of the whole run, up to 65,536
        each: they are reallocated as they grow, so all of them counts) with the arrays'
        over-allocation, plus 32 KiB for the last batches the graph sizes hold."""
        return int(8 * 1.25 * (self.decode_steps + self.finished)) + (32 << 10)

    def lines(self) -> list[str]:
        mib = 1 << 20
        first, last = (self.rss[0][0], self.rss[-1][0]) if self.rss else (0, 0)
        return [
            f"decode steps {self.decode_steps} (+{self.prefill_steps} prefill), "
            f"{self.finished} requests, {self.seconds:.1f} s",
            f"batch sizes {dict(sorted(self.batch_sizes.items()))}",
            f"RSS steps {first}-{last}: {self.rss[0][1] / mib:.1f} MiB, growth "
            f"{self.rss_growth / mib:.2f} MiB while {self.finished_in_rss_window} requests "
            "finished",
            f"tracemalloc steps {last}-{self.decode_steps}: {self.leaked_bytes} B kept outside "
            f"dsv32_engine/serving/, {self.record_bytes} B in dsv32_engine/serving/ (bound {self.record_bound} B), "
            f"{self.steps_in_traced_window} steps and {self.finished_in_traced_window} "
            "requests finished in the window",
        ]


class Probe:
    """Wraps the engine's decode step: a warm-up, an RSS window, then a tracemalloc window.

    tracemalloc costs memory of its own (more than ``get_tracemalloc_memory`` reports), so
    RSS is sampled before it starts: from step ``warmup`` to ``trace_from``, every ``every``
    steps. Tracing then runs to the end of the run.
    """

    def __init__(self, engine: DecodeEngine, warmup: int, trace_from: int, every: int) -> None:
        self.engine = engine
        self.warmup = warmup
        self.trace_from = trace_from
        self.every = every
        self.report = SoakReport()
        self._finished_at = 0
        self._step = engine._decode_step
        engine._decode_step = self._decode_step

    def _finished(self) -> int:
        return self.engine.scheduler.finished_count

    def _decode_step(self, requests, result):
        self.report.batch_sizes[len(requests)] += 1
        accepted = self._step(requests, result)
        n = sum(self.report.batch_sizes.values())
        if n == self.warmup:
            self._finished_at = self._finished()
        if self.warmup <= n <= self.trace_from and (n - self.warmup) % self.every == 0:
            self.report.rss.append((n, rss_bytes(trim=True)))
        if n == self.trace_from:
            self.report.finished_in_rss_window = self._finished() - self._finished_at
            self._finished_at = self._finished()
            tracemalloc.start(1)  # innermost frame only: several times cheaper than deeper stacks
        return accepted

    def finish(self) -> None:
        if not tracemalloc.is_tracing():
            return
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
        )
        tracemalloc.stop()
        leaked, kept = [], []
        for stat in snapshot.statistics("lineno"):
            (kept if SERVING in stat.traceback[0].filename else leaked).append(stat)
        self.report.leaked_bytes = sum(s.size for s in leaked)
        self.report.leaked_top = [
            f"{s.size} B in {s.count} blocks at {s.traceback[0]}" for s in leaked[:5]
        ]
        self.report.record_bytes = sum(s.size for s in kept)
        self.report.record_top = [
            f"{s.size} B in {s.count} blocks at {s.traceback[0]}" for s in kept[:5]
        ]
        self.report.finished_in_traced_window = self._finished() - self._finished_at
        steps = sum(self.report.batch_sizes.values())
        self.report.steps_in_traced_window = max(0, steps - self.trace_from)


def soak(
    decode_steps: int,
    *,
    warmup: int,
    trace_from: int,
    every: int,
    seed: int = 0,
    layers: int | None = None,
) -> tuple[SoakReport, DecodeEngine]:
    """Serve a workload of at least ``decode_steps`` decode steps; return the report and engine."""
    engine = tiny_engine(workload(decode_steps, seed, layers))
    probe = Probe(engine, warmup, trace_from, every)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False)
    probe.report.decode_steps = result.decode_steps
    probe.finish()
    report = probe.report
    report.seconds = time.perf_counter() - start
    report.prefill_steps = result.prefill_steps
    report.finished = result.finished
    report.eager = dict(engine.runner.stats.eager)
    report.graph_warnings = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    return report, engine


def check(report: SoakReport, engine: DecodeEngine, *, steps: int, rss_mib: float, leak_bytes: int):
    text = "\n".join(report.lines() + report.leaked_top + report.record_top)
    requests = engine.config.loop.requests
    assert report.decode_steps >= steps, text
    assert report.finished == requests, text
    # arrivals and departures: batches of every size, the runner replaying them all
    assert set(report.batch_sizes) == set(range(1, 9)), text
    # KV pages and request rows all returned; freed rows zeroed
    assert engine.cache.num_used_pages == 0, text
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1, text
    assert engine.pool.num_free == engine.pool.pool_size - 1, text
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.pool.req_to_token.any()
    # no eager fallback, no dropped capture, nothing warned
    assert report.eager == {} and report.graph_warnings == [], text
    assert engine.runner.stats.graph_steps == report.decode_steps
    # one computation of each field per batch of its mode (decode replays, eager extend plans)
    stats = engine.planner.stats
    batches = stats.batches["replay"] + stats.batches["eager"]
    assert sum(stats.program_runs.values()) == batches
    for mode, runs in stats.program_runs.items():
        keys = {step.key for step in stats.programs[mode]}
        assert all(stats.field_calls[k] >= runs for k in keys), (mode, dict(stats.field_calls))
    # memory flat after warm-up: nothing kept per finished request, nothing leaked
    assert report.rss_growth < rss_mib * (1 << 20), text
    assert report.leaked_bytes < leak_bytes, text
    assert report.record_bytes <= report.record_bound, text
    assert engine.scheduler.finished_count == requests


def test_soak_300_decode_steps():
    report, engine = soak(300, warmup=100, trace_from=200, every=25, layers=2)
    print("\n".join(report.lines()))
    check(report, engine, steps=250, rss_mib=1, leak_bytes=64 << 10)


@pytest.mark.slow
def test_soak_10000_decode_steps():
    report, engine = soak(10_000, warmup=1_000, trace_from=6_000, every=250, seed=1)
    print("\n".join(report.lines()))
    check(report, engine, steps=10_000, rss_mib=1, leak_bytes=64 << 10)


def test_rss_probe_reads_this_process():
    before = rss_bytes()
    block = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB, touched
    assert rss_bytes() - before > 4 << 20
    del block


def test_gpu_soak_script_runs_on_emulated_graphs(tmp_path):
    """A smoke run of ``python -m benchmarks soak_gpu`` on the CPU, so the GPU script cannot
    rot."""
    import json

    from benchmarks.soak import soak_gpu as script

    out = tmp_path / "soak.json"
    args = ["--device", "cpu", "--config", "dsv32-tiny.yaml", "--sequences", "12"]
    args += ["--runners", "2", "--max-batch", "8", "--max-context", "320"]
    args += ["--decode-steps", "24", "--warmup", "8", "--every", "4"]
    args += ["--prompt-len", "2", "4", "--max-new-tokens", "2", "8", "--out", str(out)]
    result = script.run(args)
    saved = json.loads(out.read_text())
    assert result["ok"] and saved["ok"], json.dumps(saved, indent=1)[:2000]
    assert saved["fuzz"]["mismatches"] == 0 and saved["fuzz"]["replays"] > 0
    assert (
        saved["decode"]["checks"]["pages_returned"] and saved["decode"]["graph_kind"] == "emulated"
    )
