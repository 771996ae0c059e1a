"""Raw batch inputs, staged into one host buffer and moved with one copy.

Per-request inputs (lengths, pool indices, positions, cache locations) are
small; sending each with its own host-to-device copy costs a launch and a
driver call apiece. They are written side by side into one (pinned) int32
buffer, padding rows included, and copied in one transfer. Before the host
buffer is overwritten for the next batch, the previous copy is awaited: two
batches never race on one pinned buffer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from planner.batch import ForwardBatch, check_table_width
from planner.errors import BatchError

_FIELD_OF_SOURCE = {"seq_lens": "seq_lens_cpu"}
_UNCHECKED = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


def _fits_int32(source: str, values: np.ndarray, limits: dict[str, tuple[int, int]]) -> None:
    """int64 inputs are staged as int32: a value past int32 would wrap into a valid-looking one."""
    low, high = int(values.min()), int(values.max())
    if low < _INT32[0] or high > _INT32[1]:
        lo, hi = limits.get(source, _INT32)
        raise BatchError(
            "value out of range",
            field=_FIELD_OF_SOURCE.get(source, source),
            expected=f"[{lo}, {hi}]",
            actual=low if low < _INT32[0] else high,
        )


@dataclass(frozen=True)
class Segment:
    """Where one source lives in the staging buffer."""

    source: str
    per_token: bool
    pad: int
    offset: int
    capacity: int


class StagingLayout:
    """Segments for every distinct (source, pad) the schemas stage, sized for capacity."""

    def __init__(
        self, sources: Iterable[tuple[str, bool, int]], max_reqs: int, next_n: int
    ) -> None:
        self.segments: dict[tuple[str, int], Segment] = {}
        offset = 0
        for source, per_token, pad in sources:
            key = (source, pad)
            if key in self.segments:
                continue
            capacity = max_reqs * next_n if per_token else max_reqs
            self.segments[key] = Segment(source, per_token, pad, offset, capacity)
            offset += capacity
        self.size = offset
        self._order = tuple(self.segments.values())
        self._bounds: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _bounds_for(
        self,
        key: tuple,
        real: int,
        next_n: int,
        limits: dict[str, tuple[int, int]],
        skip: frozenset,
    ) -> tuple[np.ndarray, np.ndarray]:
        bounds = self._bounds.get(key)
        if bounds is None:
            lo = np.full(self.size, _UNCHECKED[0], dtype=np.int64)
            hi = np.full(self.size, _UNCHECKED[1], dtype=np.int64)
            for seg in self.segments.values():
                if seg.offset in skip or seg.source not in limits:
                    continue
                n = real * next_n if seg.per_token else real
                lo[seg.offset : seg.offset + n], hi[seg.offset : seg.offset + n] = limits[
                    seg.source
                ]
            bounds = self._bounds[key] = (lo, hi)
        return bounds

    def check_ranges(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        next_n: int,
        limits: dict[str, tuple[int, int]],
        on_device: list,
    ) -> None:
        """Every staged host input within its limits, in one vectorised pass.

        ``limits`` maps a source to its inclusive ``(lo, hi)``; ``seq_lens``
        is bounded by ``max_context``, and by the token table's width, which
        gets its own error. Inputs already on the device are not read here.
        """
        skip = frozenset(seg.offset for seg, _ in on_device)
        table = batch.req_to_token
        key = (batch.bs, next_n, table.shape[0], table.shape[1], skip)
        lo, hi = self._bounds_for(key, batch.bs, next_n, limits, skip)
        flat = host[: self.size]
        bad = (flat < lo) | (flat > hi)
        if not bad.any():
            return
        index = int(np.flatnonzero(bad)[0])
        seg = next(s for s in self.segments.values() if s.offset <= index < s.offset + s.capacity)
        value = int(flat[index])
        low, high = limits[seg.source]
        if seg.source == "seq_lens" and low <= value <= limits["_max_context"][1]:
            check_table_width(table, value)
        field = _FIELD_OF_SOURCE.get(seg.source, seg.source)
        raise BatchError(
            "value out of range", field=field, expected=f"[{low}, {high}]", actual=value
        )

    def fill_host(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        reqs: int,
        next_n: int,
        limits: dict[str, tuple[int, int]],
    ) -> list:
        """Write each source, then its pad, into ``host``; return device-resident sources.

        Device-resident inputs cannot be written from the host; they are
        returned as (segment, tensor) so the caller copies them on the device
        after the one host-to-device transfer.
        """
        on_device = []
        real = batch.bs
        flat = host  # a numpy view: slicing costs a fraction of a torch op per segment
        for seg in self._order:
            width = next_n if seg.per_token else 1
            start, mid, end = seg.offset, seg.offset + real * width, seg.offset + reqs * width
            value = batch.source(seg.source)
            if value.is_cuda:
                on_device.append((seg, value))
            else:
                values = value.numpy()
                if values.dtype != np.int32 and values.size:
                    _fits_int32(seg.source, values, limits)
                flat[start:mid] = values
            flat[mid:end] = seg.pad
        return on_device


class StaticStager:
    """The planner's persistent staging pair: pinned host buffer and its device twin."""

    def __init__(self, layout: StagingLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        pinned = device.type == "cuda"
        self.host = torch.zeros(max(layout.size, 1), dtype=torch.int32, pin_memory=pinned)
        self.host_view = self.host.numpy()  # made once: .numpy() costs microseconds per call
        self.device_buf = torch.zeros(max(layout.size, 1), dtype=torch.int32, device=device)
        self._copy_done = torch.cuda.Event() if pinned else None
        self.copies = 0

    def view(self, segment: Segment, n: int) -> torch.Tensor:
        return self.device_buf[segment.offset : segment.offset + n]

    def stage(
        self, batch: ForwardBatch, reqs: int, next_n: int, limits: dict[str, tuple[int, int]]
    ) -> None:
        """Fill the host buffer, check it, one host-to-device copy, then device-resident inputs."""
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous batch's copy must not read a half-written buffer
        on_device = self.layout.fill_host(self.host_view, batch, reqs, next_n, limits)
        self.layout.check_ranges(self.host_view, batch, next_n, limits, on_device)
        if self.device.type == "cpu":
            self.device_buf.copy_(self.host)
        else:
            self.device_buf.copy_(self.host, non_blocking=True)
            self._copy_done.record()
        self.copies += 1
        for seg, tensor in on_device:
            n_real = batch.bs * next_n if seg.per_token else batch.bs
            self.view(seg, n_real).copy_(tensor)


def stage_fresh(
    layout: StagingLayout,
    batch: ForwardBatch,
    reqs: int,
    next_n: int,
    device: torch.device,
    limits: dict[str, tuple[int, int]],
) -> tuple[torch.Tensor, list]:
    """Eager staging into new tensors: one host buffer, checked, one transfer."""
    host = torch.empty(max(layout.size, 1), dtype=torch.int32)
    view = host.numpy()
    on_device = layout.fill_host(view, batch, reqs, next_n, limits)
    layout.check_ranges(view, batch, next_n, limits, on_device)
    dev = host.to(device) if device.type != "cpu" else host
    for seg, tensor in on_device:
        n_real = batch.bs * next_n if seg.per_token else batch.bs
        dev[seg.offset : seg.offset + n_real].copy_(tensor)
    return dev, on_device
