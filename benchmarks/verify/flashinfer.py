#!/usr/bin/env python3
"""Verify the FlashInfer backends on one GPU: eager, capture and replay against the torch reference.

Run on the CUDA machine (flashinfer-python 0.5.3 among the carried wheels)::

    source scripts/device_prelude.sh || exit 1
    python3 -m benchmarks flashinfer --out "$OUT/verify_flashinfer.json"

For each configuration (paged decode: page 1 GQA, page 16 MHA, page 16 GQA on
tensor cores; MLA: page 1, page 64, page 64 target-verify with causal rows) a
planner is built on CUDA, every capture size is captured into one CUDA graph
pool (``planner.capture``, warm-up forward, ``torch.cuda.graph`` around
``planner.record`` + the attention forward), then ``--sequences`` random
batches (sizes 1..max_batch, lengths short, long, uniform or equal) go through:

* eager: ``planner.plan`` + the forward with FlashInfer's eager wrapper;
* replay: ``planner.replay`` + ``graph.replay()`` on the next captured size;
* the fp32 torch reference over the eager plan's fields.

Checks per batch: both outputs within bf16 tolerance of the reference (the
capture-time warm-up output too, for the dummy batch); ``planner.verify``
(replayed metadata bit-equal to an eager plan padded alike, padding rows
holding pad values); plan tensors at their captured addresses; the graph
wrapper the same object, bound to exactly the plan's tensors; no synchronising
CUDA call on the replay path (``torch.cuda.set_sync_debug_mode("warn")``).
Prints a summary table, writes JSON to ``--out``, exits 1 on any failure and 2
without CUDA or flashinfer unless ``--allow-cpu`` (a smoke test of this script
with the reference standing in for FlashInfer and graphs emulated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from backends.flashinfer import (
    flashinfer_decode_attention,
    flashinfer_importable,
    flashinfer_mla_attention,
    release_wrappers,
)
from backends.flashinfer.wrappers import load_flashinfer
from planner import ForwardBatch, ForwardMode, Limits, Planner

GPU_STEPS = {
    "": "--out {out}/verify_flashinfer.json",
}

LENGTH_KINDS = ("uniform", "short", "long", "equal")
ATOL = RTOL = 1e-2  # bf16 inputs and output against an fp32 reference


# --------------------------------------------------------------------------- configurations
# One frozen ``Config`` per FlashInfer path worth verifying (paged decode at page 1 and 16, on
# tensor cores, MLA at page 1 and 64, MLA target-verify), so the script and the GPU tests
# (tests/gpu/test_flashinfer_gpu.py) cover the same set; and their CPU smoke sizes.


@dataclass(frozen=True)
class Config:
    """One backend configuration: the planner limits, the model dims, the capture sizes."""

    backend: str
    page_size: int
    heads: int
    kv_heads: int = 1
    head_dim: int = 128
    next_n: int = 1
    max_batch: int = 64
    max_context: int = 4096
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    use_tensor_cores: bool = False
    mla_backend: str = "auto"

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.TARGET_VERIFY if self.next_n > 1 else ForwardMode.DECODE

    def options(self) -> dict[str, Any]:
        if self.backend == "flashinfer_decode":
            return {
                "num_qo_heads": self.heads,
                "num_kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "use_tensor_cores": self.use_tensor_cores,
            }
        return {"num_heads": self.heads, "mla_backend": self.mla_backend}


CONFIGS = {
    "decode_p1_gqa": Config("flashinfer_decode", 1, heads=32, kv_heads=8, max_context=2048),
    "decode_p16_mha": Config("flashinfer_decode", 16, heads=16, kv_heads=16),
    "decode_p16_tc": Config("flashinfer_decode", 16, heads=32, kv_heads=4, use_tensor_cores=True),
    "mla_p1": Config("flashinfer_mla", 1, heads=16, max_context=2048),
    "mla_p64": Config("flashinfer_mla", 64, heads=16),
    "mla_p64_verify": Config("flashinfer_mla", 64, heads=16, next_n=2),
}


def cpu_smoke(config: Config) -> Config:
    """Small dims for ``--allow-cpu``: the script's logic, not FlashInfer's numbers."""
    small = {"heads": min(config.heads, 4), "kv_heads": min(config.kv_heads, 2), "head_dim": 64}
    if config.backend == "flashinfer_mla":
        small = {"heads": 2}
    return replace(config, max_batch=6, max_context=160, sizes=(1, 2, 4, 6), **small)


# --------------------------------------------------------------------------- inputs
# Token tables, random batches, one planner's setup. Batches come as a scheduler hands them
# over (host lengths, shuffled whole pages per request) with sizes biased to the capture
# edges, where padding goes wrong first.


def make_table(rows: int, max_context: int, page_size: int, seed: int) -> torch.Tensor:
    """req_to_token: row 0 the null request (slot 0), other rows own shuffled whole pages."""
    pages = -(-max_context // page_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm((rows - 1) * pages, generator=g).view(rows - 1, pages) + 1
    slots = ids[:, :, None] * page_size + torch.arange(page_size)
    table = torch.zeros(rows, max_context, dtype=torch.int32)
    table[1:] = slots.reshape(rows - 1, -1)[:, :max_context].to(torch.int32)
    return table


def make_lens(rng: random.Random, bs: int, config: Config, kind: str) -> list[int]:
    n, ctx = config.next_n, config.max_context
    if kind == "short":
        return [rng.randint(n, min(ctx, 2 * config.page_size + 3)) for _ in range(bs)]
    if kind == "long":
        return [rng.randint(max(n, ctx // 2), ctx) for _ in range(bs)]
    if kind == "equal":
        return [rng.randint(n, ctx)] * bs
    return [rng.randint(n, ctx) for _ in range(bs)]


def make_batch(
    rng: random.Random, config: Config, table_cpu: torch.Tensor, table: torch.Tensor
) -> ForwardBatch:
    """A valid batch with host inputs, as a scheduler hands it over; sizes hit capture edges."""
    edges = [s + d for s in config.sizes for d in (0, 1) if 1 <= s + d <= config.max_batch]
    bs = rng.choice(edges) if rng.random() < 0.3 else rng.randint(1, config.max_batch)
    lens = make_lens(rng, bs, config, rng.choice(LENGTH_KINDS))
    reqs = rng.sample(range(1, table_cpu.shape[0]), bs)
    n = config.next_n
    cols = torch.tensor([[length - n + i for i in range(n)] for length in lens], dtype=torch.int64)
    pool = torch.tensor(reqs, dtype=torch.int64)
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        req_pool_indices=pool,
        req_to_token=table,
        out_cache_loc=table_cpu[pool[:, None], cols].reshape(-1).contiguous(),
        mode=config.mode,
        next_n=n,
    )


@dataclass
class Setup:
    config: Config
    device: torch.device
    planner: Planner
    table: torch.Tensor
    table_cpu: torch.Tensor
    caches: tuple[torch.Tensor, ...]

    def inputs(self, rows: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        c, dev = self.config, self.device
        if c.backend == "flashinfer_decode":
            return (torch.randn(rows, c.heads, c.head_dim, generator=g).to(dev, torch.bfloat16),)
        nope = torch.randn(rows, c.heads, 512, generator=g).to(dev, torch.bfloat16)
        return nope, torch.randn(rows, c.heads, 64, generator=g).to(dev, torch.bfloat16)

    def forward(self, plans: Any, inputs: tuple[torch.Tensor, ...], impl: str) -> torch.Tensor:
        plan = plans[self.config.backend]
        if self.config.backend == "flashinfer_decode":
            return flashinfer_decode_attention(plan, inputs[0], self.caches, impl=impl)
        return flashinfer_mla_attention(plan, *inputs, *self.caches, impl=impl)

    def reference(self, plans: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.forward(plans, tuple(t.float() for t in inputs), "reference")


def build(config: Config, device: torch.device, seed: int) -> Setup:
    limits = Limits(
        max_batch=config.max_batch,
        max_context=config.max_context,
        page_size=config.page_size,
        next_n=config.next_n,
        device=str(device),
    )
    planner = Planner([config.backend], limits, options={config.backend: config.options()})
    table_cpu = make_table(config.max_batch * 2 + 1, config.max_context, config.page_size, seed)
    pages = int(table_cpu.max()) // config.page_size + 1
    g = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    if config.backend == "flashinfer_decode":
        shape = (pages, config.page_size, config.kv_heads, config.head_dim)
        caches = (rand(*shape), rand(*shape))
    else:
        caches = (rand(pages, config.page_size, 512), rand(pages, config.page_size, 64))
    return Setup(config, device, planner, table_cpu.to(device), table_cpu, caches)


# --------------------------------------------------------------------------- report
# The counters of ``Report`` are what the run is judged by (``ok``); its JSON is the
# script's ``configs`` entries and ``summarize`` its printed table.


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0


def within_tolerance(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=RTOL))


@dataclass
class Report:
    name: str
    config: dict[str, Any]
    steps: int = 0
    eager_max_err: float = 0.0
    replay_max_err: float = 0.0
    replay_vs_eager: float = 0.0
    warmup_max_err: float = 0.0
    bad_outputs: int = 0
    verify_failures: int = 0
    pointer_failures: int = 0
    sync_warnings: int = 0
    replay_host_us: list[float] = field(default_factory=list)
    eager_host_us: list[float] = field(default_factory=list)
    capture_s: float = 0.0
    providers: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        bad = self.bad_outputs + self.verify_failures + self.pointer_failures + self.sync_warnings
        return self.error is None and self.steps > 0 and bad == 0 and self.warmup_max_err <= 0.5

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(message)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("replay_host_us", "eager_host_us"):
            values = data.pop(key)
            data[f"{key}_median"] = statistics.median(values) if values else None
        data["ok"] = self.ok
        return data


def summarize(reports: list[Report]) -> str:
    head = (
        f"{'config':<16} {'steps':>5} {'eager err':>9} {'replay err':>10} {'r-e':>8} {'warmup':>8} "
        f"{'bad':>4} {'verify':>6} {'ptrs':>5} {'syncs':>5} {'replay us':>9} {'eager us':>9} {'ok':>3}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        j = r.to_json()
        lines.append(
            f"{r.name:<16} {r.steps:>5} {r.eager_max_err:>9.2e} {r.replay_max_err:>10.2e} "
            f"{r.replay_vs_eager:>8.1e} {r.warmup_max_err:>8.1e} {r.bad_outputs:>4} "
            f"{r.verify_failures:>6} {r.pointer_failures:>5} {r.sync_warnings:>5} "
            f"{j['replay_host_us_median'] or 0:>9.0f} {j['eager_host_us_median'] or 0:>9.0f} "
            f"{'yes' if r.ok else 'NO':>3}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- capture
# Every size captured, largest first into one CUDA graph pool, as the graph runner does;
# the warm-up forward is checked against the reference too (the capture-time dummy batch).
# On the CPU the "graph" re-runs ``planner.record`` + the forward over the same static
# tensors, so the script's logic runs without CUDA.


@dataclass
class Captured:
    bs: int
    plans: Any
    statics: tuple[torch.Tensor, ...]
    out: torch.Tensor | None
    replay: Callable[[], torch.Tensor]
    pointers: dict[str, int]
    slot: Any
    warmup_err: float


def capture_all(setup: Setup, g: torch.Generator) -> dict[int, Captured]:
    """Largest size first into one pool, as the graph runner does; warm-up checked too."""
    c, planner = setup.config, setup.planner
    cuda = setup.device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if cuda else None
    top = max(c.sizes) * c.next_n
    statics = tuple(torch.zeros_like(t) for t in setup.inputs(top, g))
    captured: dict[int, Captured] = {}
    for bs in sorted(c.sizes, reverse=True):
        plans = planner.capture(bs, c.mode, req_to_token=setup.table)
        views = tuple(t[: bs * c.next_n] for t in statics)
        for view, value in zip(views, setup.inputs(bs * c.next_n, g), strict=True):
            view.copy_(value)
        warm = setup.forward(plans, views, "auto")  # JIT, allocator, and a capture-phase check
        err = max_err(warm, setup.reference(plans, views))
        plan = plans[c.backend]
        pointers = {name: t.data_ptr() for name, t in plan.tensors().items()}
        slot = plan.wrapper.slot
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                planner.record(bs, c.mode)
                out = setup.forward(plans, views, "auto")

            def replay(graph=graph, out=out) -> torch.Tensor:
                graph.replay()
                return out

        else:  # emulated: re-run the captured callable over the same static tensors

            def replay(bs=bs, plans=plans, views=views) -> torch.Tensor:
                planner.record(bs, c.mode)
                return setup.forward(plans, views, "auto")

            out = None
        captured[bs] = Captured(bs, plans, views, out, replay, pointers, slot, err)
    return captured


# --------------------------------------------------------------------------- per-batch checks
# For every random batch: both outputs within bf16 tolerance of the fp32 reference,
# ``planner.verify`` on the replayed plans, plan tensors at their captured addresses, the
# graph wrapper bound to exactly the plan's tensors, and no synchronising CUDA call on the
# replay path.


def _wrapper_binding_ok(slot: Any, plan: Any, backend: str) -> bool:
    """The graph wrapper reads exactly the plan's tensors (no copies, no stale buffers)."""
    w = getattr(slot, "wrapper", None)
    if w is None:
        return True  # the reference path has no wrapper to bind
    if backend == "flashinfer_decode":
        pairs = [
            (w._paged_kv_indptr_buf, plan.kv_indptr),
            (w._paged_kv_indices_buf, plan.kv_indices),
            (w._paged_kv_last_page_len_buf, plan.kv_last_page_len),
        ]
    else:
        pairs = [
            (w._qo_indptr_buf, plan.qo_indptr),
            (w._kv_indptr_buf, plan.kv_indptr),
            (w._kv_indices_buf, plan.kv_indices),
            (w._kv_len_arr_buf, plan.kv_len_arr),
        ]
    return all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in pairs)


def _replay_quietly(
    setup: Setup, batch: ForwardBatch, entry: Captured
) -> tuple[Any, torch.Tensor, list[str], float]:
    """planner.replay + graph replay with CUDA sync detection on; returns warnings seen."""
    cuda = setup.device.type == "cuda"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            start = time.perf_counter()
            plans = setup.planner.replay(batch, entry.bs)
            host_us = (time.perf_counter() - start) * 1e6
            out = entry.replay()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    # torch announces the debug mode itself once per process ("... is a prototype feature"):
    # that notice is not a synchronising call.
    syncs = [
        str(w.message)
        for w in seen
        if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)
    ]
    return plans, out, syncs, host_us


def run_config(
    name: str, config: Config, device: torch.device, sequences: int, seed: int
) -> Report:
    """Capture every size, then ``sequences`` random batches through eager and replay."""
    report = Report(name, asdict(config))
    release_wrappers()
    try:
        setup = build(config, device, seed)
        report.providers = setup.planner.providers_chosen(config.mode)
        g = torch.Generator().manual_seed(seed + 2)
        start = time.perf_counter()
        captured = capture_all(setup, g)
        report.capture_s = time.perf_counter() - start
        report.warmup_max_err = max(e.warmup_err for e in captured.values())
        rng = random.Random(seed)
        sizes = sorted(captured)
        for step in range(sequences):
            _one_batch(setup, captured, sizes, rng, g, report, step)
    except Exception:
        report.error = traceback.format_exc()
    finally:
        release_wrappers()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _one_batch(
    setup: Setup,
    captured: dict[int, Captured],
    sizes: list[int],
    rng: random.Random,
    g: torch.Generator,
    report: Report,
    step: int,
) -> None:
    c = setup.config
    batch = make_batch(rng, c, setup.table_cpu, setup.table)
    rows = batch.bs * c.next_n
    inputs = setup.inputs(rows, g)
    start = time.perf_counter()
    eager_plans = setup.planner.plan(batch)
    report.eager_host_us.append((time.perf_counter() - start) * 1e6)
    eager = setup.forward(eager_plans, inputs, "auto")
    ref = setup.reference(eager_plans, inputs)
    entry = captured[min(s for s in sizes if s >= batch.bs)]
    for view, value in zip(entry.statics, inputs, strict=True):
        view[:rows].copy_(value)
        view[rows:].zero_()
    plans, out, syncs, host_us = _replay_quietly(setup, batch, entry)
    replayed = out[:rows]
    report.replay_host_us.append(host_us)
    where = f"step {step}: bs {batch.bs} -> {entry.bs}, max len {int(batch.seq_lens_cpu.max())}"
    e_err, r_err = max_err(eager, ref), max_err(replayed, ref)
    report.eager_max_err = max(report.eager_max_err, e_err)
    report.replay_max_err = max(report.replay_max_err, r_err)
    report.replay_vs_eager = max(report.replay_vs_eager, max_err(replayed, eager))
    if not (within_tolerance(eager, ref) and within_tolerance(replayed, ref)):
        report.bad_outputs += 1
        report.fail(f"{where}: eager err {e_err:.3g}, replay err {r_err:.3g}")
    if syncs:
        report.sync_warnings += len(syncs)
        report.fail(f"{where}: synchronising call on the replay path: {syncs[0][:200]}")
    try:
        setup.planner.verify(batch, plans)
    except Exception as exc:
        report.verify_failures += 1
        report.fail(f"{where}: verify: {exc}")
    plan = plans[c.backend]
    moved = [n for n, t in plan.tensors().items() if t.data_ptr() != entry.pointers[n]]
    slot = plan.wrapper.slot
    if (
        plans is not entry.plans
        or moved
        or slot is not entry.slot
        or not _wrapper_binding_ok(slot, plan, c.backend)
    ):
        report.pointer_failures += 1
        report.fail(f"{where}: identity: moved {moved}, same slot {slot is entry.slot}")
    report.steps += 1


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON summary path")
    p.add_argument("--sequences", type=int, default=100, help="random batches per config")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--mla-backend", default=None, help="force fa2/fa3 for the MLA configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-cpu", action="store_true", help="smoke-test without CUDA/flashinfer")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    usable = cuda and flashinfer_importable()
    if not usable and not args.allow_cpu:
        print("verify_flashinfer: needs CUDA and flashinfer (or --allow-cpu)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        print(
            f"verify_flashinfer: unknown configs {unknown}; known: {sorted(CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    if not usable:
        print("WARNING: no CUDA/flashinfer: the torch reference stands in (smoke test only)")
    t0 = time.time()
    reports = []
    for name in names:
        config = CONFIGS[name]
        if args.mla_backend and config.backend == "flashinfer_mla":
            config = replace(config, mla_backend=args.mla_backend)
        if not usable:
            config = cpu_smoke(config)
        t = time.time()
        report = run_config(name, config, device, args.sequences, args.seed)
        reports.append(report)
        state = "ok" if report.ok else "FAILED"
        print(
            f"[{name}] {report.steps} batches, capture {report.capture_s:.1f} s, {time.time() - t:.1f} s: {state}",
            flush=True,
        )
    results = {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "flashinfer": _flashinfer_version() if usable else None,
            "stand_in": not usable,
            "seed": args.seed,
            "sequences": args.sequences,
            "atol": ATOL,
            "rtol": RTOL,
        },
        "configs": [r.to_json() for r in reports],
        "wall_s": time.time() - t0,
    }
    results["ok"] = all(r.ok for r in reports)
    print(summarize(reports))
    for r in reports:
        for f in r.failures[:5]:
            print(f"FAIL [{r.name}] {f}")
        if r.error:
            print(f"ERROR [{r.name}]\n{r.error}")
    print(f"overall: {'OK' if results['ok'] else 'FAILED'} in {results['wall_s']:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if results["ok"] else 1


def _flashinfer_version() -> str | None:

    return getattr(load_flashinfer(), "__version__", None)


if __name__ == "__main__":
    sys.exit(main())
