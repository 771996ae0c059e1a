"""The busy fraction's arithmetic (the union of device intervals) and GpuBusy's bookkeeping:
which steps the profiler window holds, which steps are pace samples, a window cut short by
the end of the loop, and the refusals. A fake profiler stands in for CUPTI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv32_engine.serving.busy import GpuBusy, busy_seconds, device_intervals
from planner.errors import ConfigError

CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.device("cpu")


def event(start_us, end_us, *, device=CUDA, kind="kernel", annotation=False):
    return SimpleNamespace(
        time_range=SimpleNamespace(start=start_us, end=end_us),
        device_type=device,
        activity_type=kind,
        is_user_annotation=annotation,
    )


class FakeProfiler:
    def __init__(self, events, log):
        self._events, self.log = events, log

    def start(self):
        self.log.append("start")

    def stop(self):
        self.log.append("stop")

    def events(self):
        self.log.append("events")
        return self._events


def make(start, steps, events=(), log=None):
    log = [] if log is None else log
    busy = GpuBusy(
        start,
        steps,
        CPU,
        profiler_factory=lambda: FakeProfiler(list(events), log),
        sync=lambda: log.append("sync"),
    )
    return busy, log


def test_union_of_overlapping_nested_touching_and_empty():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0)]) == 2.0  # overlapping
    assert busy_seconds([(0.0, 4.0), (1.0, 2.0)]) == 4.0  # nested
    assert busy_seconds([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # touching
    assert busy_seconds([(3.0, 3.0), (5.0, 4.0)]) == 0.0  # empty and reversed
    assert busy_seconds([(5.0, 6.0), (0.0, 1.0)]) == 2.0  # unsorted, disjoint


intervals = st.lists(
    st.tuples(st.integers(-20, 20), st.integers(-20, 20)).map(lambda t: (min(t), max(t))),
    max_size=12,
)


@given(intervals)
def test_union_matches_counting_unit_cells(spans):
    covered = {x for start, end in spans for x in range(start, end)}
    assert busy_seconds(spans) == len(covered)


def test_device_intervals_keep_kernels_copies_and_fills_only():
    events = [
        event(0, 10),
        event(10, 20, kind="gpu_memcpy"),
        event(20, 30, kind="gpu_memset"),
        event(0, 100, kind="gpu_user_annotation", annotation=True),  # spans the gaps
        event(0, 100, device=torch.autograd.DeviceType.CPU, kind="cpu_op"),
        event(40, 50, kind="cuda_runtime"),
    ]
    flat = [t for interval in device_intervals(events) for t in interval]
    assert flat == pytest.approx([0, 1e-5, 1e-5, 2e-5, 2e-5, 3e-5])


def test_device_intervals_without_activity_types():
    """torch 2.11 (the GPU machine's) has no ``FunctionEvent.activity_type``: its CUDA
    events that are no user annotation are the kernels, copies and fills."""

    def older(start_us, end_us, **kwargs):
        e = event(start_us, end_us, **kwargs)
        del e.activity_type
        return e

    events = [
        older(0, 10),
        older(0, 100, annotation=True),
        older(0, 100, device=torch.autograd.DeviceType.CPU),
    ]
    assert [t for interval in device_intervals(events) for t in interval] == pytest.approx(
        [0, 1e-5]
    )


def test_window_holds_its_steps_and_pace_skips_warmup_window_and_closing_step():
    # two streams overlap in 0..300 us; a lone kernel at 1000..1100: 400 us in all
    busy, log = make(4, 2, [event(0, 200), event(100, 300), event(1000, 1100)])
    for step in range(10):
        busy.at_step(step)
        busy.loop_step(step, 0.001 * (step + 1))
        if step == 4:
            assert log == ["sync", "start"]
    busy.finish(10)
    assert log == ["sync", "start", "sync", "stop"]  # the events wait for summary()
    summary = busy.summary()
    assert log[-1] == "events"
    # the pace: steps 2..3 before the window (0..1 warm-up) and 7..8 after the closing step
    # 6 (as many as the window holds; step 9 is further off): 3, 4, 8, 9 ms, median 6 ms
    assert summary["window_steps"] == 2
    assert summary["device_ms_per_step"] == pytest.approx(0.2)
    assert summary["pace_ms_per_step"] == pytest.approx(6.0)
    assert summary["fraction"] == pytest.approx(0.2 / 6.0)
    assert summary["profiled_ms_per_step"] >= 0
    assert busy.summary() == summary and log.count("events") == 1


def test_window_cut_short_by_the_end_of_the_loop():
    busy, log = make(1, 100, [event(0, 3000)])
    for step in range(4):
        busy.at_step(step)
        busy.loop_step(step, 0.01)
    busy.finish(4)
    summary = busy.summary()
    assert summary["window_steps"] == 3
    assert summary["device_ms_per_step"] == pytest.approx(1.0)
    assert summary["pace_ms_per_step"] == pytest.approx(10.0)  # step 0 (warm-up is 0 steps)
    busy.finish(4)  # idempotent
    assert log.count("stop") == 1


def test_no_window_no_pace():
    busy, log = make(5, 2)
    for step in range(3):
        busy.at_step(step)
        busy.loop_step(step, 0.01)
    busy.finish(3)
    assert busy.summary() is None and log == []

    busy, _ = make(0, 2, [event(0, 1000)])
    for step in range(2):
        busy.at_step(step)
        busy.loop_step(step, 0.01)
    busy.finish(2)
    summary = busy.summary()
    assert summary["pace_ms_per_step"] is None and summary["fraction"] is None


def test_refusals_name_the_flag():
    with pytest.raises(ConfigError, match="needs a CUDA device") as info:
        GpuBusy(0, 1, CPU)
    assert info.value.field == "--gpu-busy"
    with pytest.raises(ConfigError, match="at least one loop step"):
        make(0, 0)
    with pytest.raises(ConfigError, match="start >= 0"):
        make(-1, 1)


def test_real_profiler_events_have_the_fields_read():
    """torch's own events (CPU ones here) carry every attribute device_intervals reads."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    assert len(prof.events()) > 0 and device_intervals(prof.events()) == []
