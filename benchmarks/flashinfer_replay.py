"""The per-batch checks of benchmarks/verify_flashinfer.py: eager and replay against the reference.

For every random batch: both outputs within bf16 tolerance of the fp32 reference,
``planner.verify`` on the replayed plans, plan tensors at their captured addresses,
the graph wrapper bound to exactly the plan's tensors, and no synchronising CUDA
call on the replay path.
"""

from __future__ import annotations

import random
import time
import traceback
import warnings
from dataclasses import asdict
from typing import Any

import torch

from backends.flashinfer import release_wrappers
from benchmarks.flashinfer_capture import Captured, capture_all
from benchmarks.flashinfer_configs import Config
from benchmarks.flashinfer_report import Report, max_err, within_tolerance
from benchmarks.flashinfer_setup import Setup, build, make_batch
from planner import ForwardBatch


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
