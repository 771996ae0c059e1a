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

import torch

from planner.batch import ForwardBatch


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

    def fill_host(self, host: torch.Tensor, batch: ForwardBatch, reqs: int, next_n: int) -> list:
        """Write each source, then its pad, into ``host``; return device-resident sources.

        Device-resident inputs cannot be written from the host; they are
        returned as (segment, tensor) so the caller copies them on the device
        after the one host-to-device transfer.
        """
        on_device = []
        real = batch.bs
        flat = host.numpy()  # numpy slicing costs a fraction of a torch op per segment
        for seg in self.segments.values():
            n_real = real * next_n if seg.per_token else real
            start, end = seg.offset, seg.offset + (reqs * next_n if seg.per_token else reqs)
            value = batch.source(seg.source)
            if value.device.type == "cpu":
                flat[start : start + n_real] = value.numpy()
            else:
                on_device.append((seg, value))
            flat[start + n_real : end] = seg.pad
        return on_device


class StaticStager:
    """The planner's persistent staging pair: pinned host buffer and its device twin."""

    def __init__(self, layout: StagingLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        pinned = device.type == "cuda"
        self.host = torch.zeros(max(layout.size, 1), dtype=torch.int32, pin_memory=pinned)
        self.device_buf = torch.zeros(max(layout.size, 1), dtype=torch.int32, device=device)
        self._copy_done = torch.cuda.Event() if pinned else None
        self.copies = 0

    def view(self, segment: Segment, n: int) -> torch.Tensor:
        return self.device_buf[segment.offset : segment.offset + n]

    def stage(self, batch: ForwardBatch, reqs: int, next_n: int) -> None:
        """Fill the host buffer, one host-to-device copy, then device-resident inputs."""
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous batch's copy must not read a half-written buffer
        on_device = self.layout.fill_host(self.host, batch, reqs, next_n)
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
    layout: StagingLayout, batch: ForwardBatch, reqs: int, next_n: int, device: torch.device
) -> tuple[torch.Tensor, list]:
    """Eager staging into new tensors: one host buffer, one transfer."""
    host = torch.empty(max(layout.size, 1), dtype=torch.int32)
    on_device = layout.fill_host(host, batch, reqs, next_n)
    dev = host.to(device) if device.type != "cpu" else host
    for seg, tensor in on_device:
        n_real = batch.bs * next_n if seg.per_token else batch.bs
        dev[seg.offset : seg.offset + n_real].copy_(tensor)
    return dev, on_device
