"""Soak: DeepSeek-V3.2 tiny decode through the engine for thousands of steps, memory flat.

``planner/serving/engine.py`` serves a Poisson workload (requests arrive and finish, so
batch sizes wander over 1..max_batch) through the planner and the emulated graph runner.
A probe wrapped around each decode step samples, after a warm-up:

- host RSS (``/proc/self/status``, ``VmRSS``): tensors live outside Python's allocator;
- ``tracemalloc``, started at the end of the warm-up, so whatever it still holds at the
  end was allocated after the warm-up and never freed. Growth in ``planner/serving/``
  is the run's own record (finished requests, their tokens, step times) and is
  reported per finished request; growth anywhere else (planner, graphs, backends,
  models, torch) is a leak.

At the end every KV page and request row is back in its free list, the token table is
all zeros, no batch fell back to eager (no ``GraphWarning``), and each op ran once per
batch.

Default suite: ~300 decode steps. ``pytest -m slow tests/test_soak.py``: 10,000.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from graphs import GraphWarning
from planner.run_config import load_run_config
from planner.serving.engine import DecodeEngine

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "dsv32-tiny.yaml"
SERVING = os.sep + os.path.join("planner", "serving") + os.sep
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


def rss_bytes() -> int:
    """Resident set size of this process."""
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
    leaked_bytes: int = 0
    """tracemalloc growth after warm-up outside planner/serving/."""
    leaked_top: list[str] = field(default_factory=list)
    record_bytes: int = 0
    """tracemalloc growth after warm-up inside planner/serving/ (the run's record)."""
    finished_after_warmup: int = 0
    tracemalloc_bytes: int = 0
    """tracemalloc's own memory at the end (it is in the RSS too)."""
    eager: dict = field(default_factory=dict)
    graph_warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rss_growth(self) -> int:
        """RSS after warm-up: largest sample minus the first."""
        values = [b for _, b in self.rss]
        return max(values) - values[0] if values else 0

    @property
    def rss_unexplained(self) -> int:
        """RSS growth less what tracemalloc itself and the run's record account for."""
        return self.rss_growth - self.tracemalloc_bytes - self.record_bytes

    def lines(self) -> list[str]:
        mib = 1 << 20
        return [
            f"decode steps {self.decode_steps} (+{self.prefill_steps} prefill), "
            f"{self.finished} requests, {self.seconds:.1f} s",
            f"batch sizes {dict(sorted(self.batch_sizes.items()))}",
            f"RSS after warm-up {self.rss[0][1] / mib:.1f} MiB, growth {self.rss_growth / mib:.2f} "
            f"MiB over {len(self.rss)} samples, {self.rss_unexplained / mib:.2f} MiB of it not "
            f"tracemalloc's own {self.tracemalloc_bytes / mib:.2f} MiB or the run record",
            f"tracemalloc growth: {self.leaked_bytes} B outside planner/serving, "
            f"{self.record_bytes} B run record ({self.finished_after_warmup} requests finished)",
        ]


class Probe:
    """Wraps the engine's decode step: warm-up, then RSS samples and tracemalloc."""

    def __init__(self, engine: DecodeEngine, warmup: int, every: int) -> None:
        self.engine = engine
        self.warmup = warmup
        self.every = every
        self.report = SoakReport()
        self.finished_at_warmup = 0
        self._step = engine._decode_step
        engine._decode_step = self._decode_step

    def _decode_step(self, requests):
        self.report.batch_sizes[len(requests)] += 1
        accepted = self._step(requests)
        n = sum(self.report.batch_sizes.values())
        if n == self.warmup:
            gc.collect()
            self.finished_at_warmup = len(self.engine.scheduler.finished)
            tracemalloc.start(1)  # innermost frame only: several times cheaper than deeper stacks
            self.report.rss.append((n, rss_bytes()))
        elif n > self.warmup and n % self.every == 0:
            self.report.rss.append((n, rss_bytes()))
        return accepted

    def finish(self) -> None:
        gc.collect()
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [
                    tracemalloc.Filter(False, tracemalloc.__file__),
                    tracemalloc.Filter(False, __file__),
                ]
            )
            self.report.tracemalloc_bytes = tracemalloc.get_tracemalloc_memory()
            tracemalloc.stop()
            leaked, record = [], 0
            for stat in snapshot.statistics("lineno"):
                if SERVING in stat.traceback[0].filename:
                    record += stat.size
                else:
                    leaked.append(stat)
            self.report.leaked_bytes = sum(s.size for s in leaked)
            self.report.leaked_top = [
                f"{s.size} B in {s.count} blocks at {s.traceback[0]}" for s in leaked[:5]
            ]
            self.report.record_bytes = record
        self.report.finished_after_warmup = (
            len(self.engine.scheduler.finished) - self.finished_at_warmup
        )
        self.report.rss.append((self.report.decode_steps, rss_bytes()))


def soak(
    decode_steps: int, *, warmup: int, every: int, seed: int = 0, layers: int | None = None
) -> tuple[SoakReport, DecodeEngine]:
    """Serve a workload of at least ``decode_steps`` decode steps; return the report and engine."""
    engine = DecodeEngine(load_run_config(TINY_YAML, workload(decode_steps, seed, layers)))
    probe = Probe(engine, warmup, every)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        result = engine.run(progress=False)
    probe.report.decode_steps = result.decode_steps
    probe.finish()
    report = probe.report
    report.seconds = time.perf_counter() - start
    report.prefill_steps = result.prefill_steps
    report.finished = len(result.tokens)
    report.eager = dict(engine.runner.stats.eager)
    report.graph_warnings = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    return report, engine


def check(report: SoakReport, engine: DecodeEngine, *, steps: int, rss_mib: float, leak_bytes: int):
    text = "\n".join(report.lines() + report.leaked_top)
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
    # one computation of each op per batch (decode replays + eager prefill plans)
    stats = engine.planner.stats
    batches = stats.batches["replay"] + stats.batches["eager"]
    assert set(stats.op_calls.values()) == {batches}, dict(stats.op_calls)
    # memory flat after warm-up
    assert report.rss_unexplained < rss_mib * (1 << 20), text
    assert report.leaked_bytes < leak_bytes, text


def test_soak_300_decode_steps():
    report, engine = soak(300, warmup=100, every=50, layers=2)
    print("\n".join(report.lines()))
    check(report, engine, steps=250, rss_mib=4, leak_bytes=64 << 10)


@pytest.mark.slow
def test_soak_10000_decode_steps():
    report, engine = soak(10_000, warmup=1_000, every=250, seed=1)
    print("\n".join(report.lines()))
    check(report, engine, steps=10_000, rss_mib=4, leak_bytes=64 << 10)
    # the run's own record grows with finished requests, not with steps
    per_request = report.record_bytes / max(1, report.finished_after_warmup)
    assert per_request < 4096, "\n".join(report.lines())


def test_rss_probe_reads_this_process():
    before = rss_bytes()
    block = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB, touched
    assert rss_bytes() - before > 4 << 20
    del block


def test_gpu_soak_script_runs_on_emulated_graphs(tmp_path):
    """A smoke run of benchmarks/soak_gpu.py on the CPU, so the GPU script cannot rot."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("soak_gpu", ROOT / "benchmarks" / "soak_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "soak.json"
    args = ["--device", "cpu", "--config", "dsv32-tiny.yaml", "--sequences", "12"]
    args += ["--runners", "2", "--max-batch", "8", "--max-context", "320"]
    args += ["--decode-steps", "24", "--warmup", "8", "--every", "4"]
    args += ["--prompt-len", "2", "4", "--max-new-tokens", "2", "8", "--out", str(out)]
    result = script.main(args)
    saved = json.loads(out.read_text())
    assert result["ok"] and saved["ok"], json.dumps(saved, indent=1)[:2000]
    assert saved["fuzz"]["mismatches"] == 0 and saved["fuzz"]["replays"] > 0
    assert (
        saved["decode"]["checks"]["pages_returned"] and saved["decode"]["graph_kind"] == "emulated"
    )
