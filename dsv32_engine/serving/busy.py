"""The GPU's busy fraction: the device time of a steady window of loop steps over their pace.

An overlapped loop is worth what it leaves the GPU idle: a busy fraction near 1 says the host
keeps up and the step is the kernels' time; well under 1 says the GPU waits for the host. The
device time comes from CUDA activity (torch.profiler with CUPTI): the union of every kernel,
memcpy and memset interval of the window, so kernels overlapping on several streams count
once. The profiler slows the host (each launch is recorded), so the window's own wall time is
no pace: the fraction is the window's device time per step over the median wall time of the
same run's unprofiled loop steps. A profiled step's kernels are the same kernels, only the
gaps between them grow, so device time per step survives the profiler and pace does not.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from planner.errors import ConfigError

DEVICE_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The profiler's activity types that keep the device busy (kineto's names for them)."""


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of half-open ``[start, end)`` intervals: time during which at
    least one of them runs, each instant counted once. Empty intervals (``end <= start``)
    add nothing."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)  # what is already counted is not counted again
        if end > start:
            total += end - start
            reach = end
    return total


def device_intervals(events: Iterable[Any]) -> list[tuple[float, float]]:
    """The ``(start, end)`` seconds of the profiler events that kept a CUDA device busy:
    kernels, memcpys and memsets (not user annotations, whose ranges span gaps too).

    ``FunctionEvent.activity_type`` is newer than torch 2.11 (the GPU machine's); where it is
    missing, a CUDA event that is no user annotation is already a kernel, memcpy or memset."""
    return [
        (event.time_range.start * 1e-6, event.time_range.end * 1e-6)
        for event in events
        if event.device_type == torch.autograd.DeviceType.CUDA
        and not event.is_user_annotation
        and getattr(event, "activity_type", None) in (None, *DEVICE_ACTIVITIES)
    ]


def _cuda_profiler() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


class GpuBusy:
    """Profile loop steps ``start`` to ``start + steps - 1`` and measure the loop's pace.

    The loop calls :meth:`at_step` at the top of every step (steps count from 0),
    :meth:`loop_step` with each step's wall time, and :meth:`finish` after its last step;
    :meth:`summary` is the result. The step whose top closes the window pays for the
    synchronisation and the profiler's stop, so it is no pace sample either; the pace is
    the median of the unprofiled steps next to the window (:meth:`loop_step`).

    ``profiler_factory`` (an object with ``start``, ``stop`` and ``events``) and ``sync``
    are seams for tests: with a profiler injected, any ``device`` is accepted.
    """

    def __init__(
        self,
        start: int,
        steps: int,
        device: torch.device,
        *,
        profiler_factory: Callable[[], Any] | None = None,
        sync: Callable[[], None] | None = None,
    ) -> None:
        if start < 0:
            raise ConfigError(
                "the profiled window starts at a loop step",
                field="--gpu-busy",
                expected="start >= 0",
                actual=start,
            )
        if steps < 1:
            raise ConfigError(
                "the profiled window needs at least one loop step",
                field="--gpu-busy",
                expected="STEPS >= 1",
                actual=steps,
            )
        if device.type != "cuda" and profiler_factory is None:
            raise ConfigError(
                "the busy fraction is measured with CUDA activity and needs a CUDA device",
                field="--gpu-busy",
                expected="device cuda",
                actual=str(device),
            )
        self.start = start
        self.steps = steps
        self.device = device
        self._factory = profiler_factory or _cuda_profiler
        if sync is None and device.type == "cuda":
            sync = functools.partial(torch.cuda.synchronize, device)
        self._sync = sync or (lambda: None)
        self._profiler: Any = None
        self._opened = 0.0
        self._window: tuple[int, float] | None = None
        """(steps profiled, wall seconds) once the window closed."""
        self._device_seconds: float | None = None
        self._pace: list[float] = []

    def at_step(self, step: int) -> None:
        """Open the window at ``start``, close it at ``start + steps`` (each after a sync,
        so the window holds exactly its steps' device work)."""
        if step == self.start and self._profiler is None and self._window is None:
            self._sync()
            self._profiler = self._factory()
            self._profiler.start()
            self._opened = time.perf_counter()
        elif step == self.start + self.steps:
            self._close(self.steps)

    def loop_step(self, step: int, seconds: float) -> None:
        """Step ``step`` took ``seconds`` of wall time: a pace sample if it lies next to the
        window, the steps from ``start // 2`` up to it (the first half are warm-up: first
        replays, allocator growth) and as many as the window holds after the step that
        closed it (which pays for the sync and the profiler's stop). Steps further off run
        other batches (a workload's tail decodes fewer requests, faster): not this pace."""
        end = self.start + self.steps
        if self.start // 2 <= step < self.start or end < step <= end + self.steps:
            self._pace.append(seconds)

    def finish(self, step: int) -> None:
        """The loop ended before step ``step`` (the number of steps it ran): a window still
        open is closed with the steps it got."""
        self._close(step - self.start)

    def _close(self, steps: int) -> None:
        if self._profiler is None or self._window is not None:
            return  # never opened, or already closed
        self._sync()
        wall = time.perf_counter() - self._opened
        self._profiler.stop()  # the events are parsed in summary(), off the loop
        if steps >= 1:
            self._window = (steps, wall)
        else:
            self._profiler = None

    def summary(self) -> dict[str, Any] | None:
        """None if no step was profiled; else per step of the window: its device time (the
        union of CUDA activity), its wall time under the profiler, the unprofiled pace (the
        median loop step outside it, None if there was none) and the busy fraction, the
        device time over the pace (None without a pace)."""
        if self._window is None:
            return None
        steps, wall = self._window
        if self._device_seconds is None:
            self._device_seconds = busy_seconds(device_intervals(self._profiler.events()))
            self._profiler = None  # its events are the largest thing kept
        device_ms = 1e3 * self._device_seconds / steps
        pace_ms = 1e3 * statistics.median(self._pace) if self._pace else None
        return {
            "window_steps": steps,
            "device_ms_per_step": device_ms,
            "profiled_ms_per_step": 1e3 * wall / steps,
            "pace_ms_per_step": pace_ms,
            "fraction": device_ms / pace_ms if pace_ms else None,
        }
