"""Raw batch inputs, staged into one host buffer, range-checked once and moved with one copy.

Per-request or per-token inputs (lengths, pool rows, positions, cache
locations) are small; sending each with its own host-to-device copy costs a
launch and a driver call apiece. They are written side by side into one int32
host buffer, padding rows included, checked against their limits in one
vectorised pass (the only value-range check the planner has), and copied in
one transfer.

The same :class:`Stager` serves every phase. A static one (capture and
replay) keeps a ring of pinned host buffers and one device buffer for the
planner's life. A fresh one (eager plans) copies into a new device buffer per
call, from a ring of pinned host buffers on CUDA (a pageable copy costs
several times a pinned one), after the host pass has added its outputs.
Either way a pinned buffer is refilled only once the copy out of it is done,
so two batches never race on one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from planner.batch import SOURCES, ForwardBatch
from planner.door import check_table_width
from planner.errors import BatchError

_FIELD_OF_SOURCE = {"seq_lens": "seq_lens_cpu", "extend_lens": "extend_lens_cpu"}
_UNCHECKED = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
_NONE: frozenset = frozenset()
_BOUNDS_CACHE = 256
_RING = 4
"""Pinned host buffers a static stager cycles through: a step fills one while the copies
of the last few may still be queued behind their graphs, so it never waits for them."""
_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


@dataclass(frozen=True)
class Ranges:
    """Inclusive ``(lo, hi)`` of each staged input; hashable, so bounds are cached per value."""

    seq_lens: tuple[int, int]
    extend_lens: tuple[int, int]
    req_pool_indices: tuple[int, int]
    out_cache_loc: tuple[int, int]
    positions: tuple[int, int]
    max_context: int

    def __getitem__(self, source: str) -> tuple[int, int]:
        return getattr(self, source)


def input_ranges(
    max_context: int,
    next_n: int,
    kv_slots: int | None,
    table: torch.Tensor,
    ragged: bool,
    partial: bool = False,
) -> Ranges:
    """The legal values of each staged input for a planner's limits, token table and mode.

    A uniform batch adds exactly ``next_n`` tokens per request (1 in decode);
    a ragged one at least one, and never more than the request's KV length; a
    draft extend (``partial``) 1..``next_n``, its rows past them padding.
    """
    if ragged or partial:
        extend = (1, max_context if ragged else next_n)
    else:
        extend = (next_n, next_n)
    return Ranges(
        seq_lens=(extend[0], min(max_context, table.shape[1])),
        extend_lens=extend,
        req_pool_indices=(0, table.shape[0] - 1),
        out_cache_loc=(0, (kv_slots if kv_slots is not None else 2**31) - 1),
        positions=(0, max_context - 1),
        max_context=max_context,
    )


@dataclass(frozen=True)
class Segment:
    """Where one source, padded with one value, lives in the staging buffer."""

    source: str
    per_token: bool
    pad: int
    offset: int
    capacity: int


class StagingLayout:
    """Segments for every distinct (source, pad) the schemas stage, sized for capacity.

    Every batch input gets a segment even when no schema reads it, so that
    every input is range-checked in the same pass.
    """

    def __init__(self, sources: Iterable[tuple[str, int]], max_reqs: int, max_tokens: int) -> None:
        wanted = list(sources)
        named = {source for source, _ in wanted}
        wanted += [(source, 0) for source in SOURCES if source not in named]
        self.segments: dict[tuple[str, int], Segment] = {}
        offset = 0
        for source, pad in wanted:
            key = (source, pad)
            if key in self.segments:
                continue
            per_token = SOURCES[source]
            capacity = max_tokens if per_token else max_reqs
            self.segments[key] = Segment(source, per_token, pad, offset, capacity)
            offset += capacity
        self.size = offset
        self._order = tuple(self.segments.values())
        self._relation = (
            self.segments.get(("extend_lens", pad_of(wanted, "extend_lens"))),
            self.segments.get(("seq_lens", pad_of(wanted, "seq_lens"))),
        )
        self._bounds: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _bounds_for(
        self, reqs: int, tokens: int, ranges: Ranges, skip: frozenset
    ) -> tuple[np.ndarray, ...]:
        key = (reqs, tokens, id(ranges), skip)  # ranges are cached per planner: ids are stable
        bounds = self._bounds.get(key)
        if bounds is None:
            lo = np.full(self.size, _UNCHECKED[0], dtype=np.int64)
            hi = np.full(self.size, _UNCHECKED[1], dtype=np.int64)
            for seg in self._order:
                if seg.offset in skip:
                    continue
                n = tokens if seg.per_token else reqs
                lo[seg.offset : seg.offset + n], hi[seg.offset : seg.offset + n] = ranges[
                    seg.source
                ]
            if len(self._bounds) >= _BOUNDS_CACHE:  # ragged batches vary: keep the cache bounded
                self._bounds.clear()
            bounds = self._bounds[key] = (lo, hi, ranges)
        return bounds[0], bounds[1]

    def fill(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
    ) -> list[tuple[Segment, torch.Tensor]]:
        """Write each source, then its pad, into ``host``; return the device-resident ones left.

        A device-resident input cannot be written from the host without a
        read; with ``read_device`` (eager and debug) it is read, staged and
        checked like a host one, otherwise it is returned as (segment,
        tensor) for a device-to-device copy after the transfer. Extend lengths
        a uniform batch leaves out are written as the constant they are, with
        no tensor made for them.
        """
        on_device = []
        real_reqs = batch.bs
        implied = None if batch.extend_lens_cpu is not None else batch.next_n
        real_tokens = real_reqs * batch.next_n if implied is not None else batch.num_tokens
        for seg in self._order:
            real, padded = (real_tokens, tokens) if seg.per_token else (real_reqs, reqs)
            start, mid, end = seg.offset, seg.offset + real, seg.offset + padded
            if seg.source == "extend_lens" and implied is not None and batch.extend_lens is None:
                host[start:mid] = implied
            else:
                value = batch.source(seg.source)
                if value.is_cuda and not read_device:
                    on_device.append((seg, value))
                else:
                    values = value.numpy() if value.is_cpu else value.cpu().numpy()
                    if values.dtype != np.int32 and values.size:
                        _fits_int32(seg.source, values, ranges)
                    host[start:mid] = values
            host[mid:end] = seg.pad
        return on_device

    def check(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        ranges: Ranges,
        on_device: list[tuple[Segment, torch.Tensor]],
    ) -> None:
        """Every staged input within its range, in one vectorised pass over ``host``.

        First the one relation between inputs: no request adds more tokens than
        its KV length holds (a negative cached prefix); it is named before the
        positions derived from it would be.
        """
        skip = frozenset(seg.offset for seg, _ in on_device) if on_device else _NONE
        if batch.extend_lens_cpu is not None:  # else implied by the mode: seq_lens' range covers it
            self._check_prefix(host, batch.bs, skip)
        lo, hi = self._bounds_for(batch.bs, batch.num_tokens, ranges, skip)
        flat = host[: self.size]
        bad = (flat < lo) | (flat > hi)
        if not bad.any():
            return
        index = int(np.flatnonzero(bad)[0])
        seg = next(s for s in self._order if s.offset <= index < s.offset + s.capacity)
        value = int(flat[index])
        low, high = ranges[seg.source]
        if seg.source == "seq_lens" and low <= value <= ranges.max_context:
            check_table_width(batch.req_to_token, value)
        raise BatchError(
            "value out of range",
            field=_FIELD_OF_SOURCE.get(seg.source, seg.source),
            expected=f"[{low}, {high}]",
            actual=value,
        )

    def _check_prefix(self, host: np.ndarray, reqs: int, skip: frozenset) -> None:
        extend, seq = self._relation
        if extend is None or seq is None or extend.offset in skip or seq.offset in skip:
            return
        new = host[extend.offset : extend.offset + reqs]
        kv = host[seq.offset : seq.offset + reqs]
        longer = np.flatnonzero(new > kv)
        if longer.size:
            i = int(longer[0])
            raise BatchError(
                "a request adds more tokens than its KV length (negative cached prefix)",
                field="extend_lens_cpu",
                expected=f"<= seq_lens_cpu[{i}] = {int(kv[i])}",
                actual=int(new[i]),
            )


def pad_of(sources: list[tuple[str, int]], name: str) -> int:
    """The pad of the first segment of source ``name`` (what the relation check compares)."""
    return next((pad for source, pad in sources if source == name), 0)


def _fits_int32(source: str, values: np.ndarray, ranges: Ranges) -> None:
    """int64 inputs are staged as int32: a value past int32 would wrap into a valid-looking one."""
    low, high = int(values.min()), int(values.max())
    if low < _INT32[0] or high > _INT32[1]:
        lo, hi = ranges[source]
        raise BatchError(
            "value out of range",
            field=_FIELD_OF_SOURCE.get(source, source),
            expected=f"[{lo}, {hi}]",
            actual=low if low < _INT32[0] else high,
        )


class Stager:
    """Stages batches through one host buffer into one device buffer; see the module docstring.

    A static stager keeps a ring of pinned host buffers: the copy out of one is
    asynchronous and queued behind the GPU work of earlier steps, so the next
    step fills the next buffer instead of waiting for it (waiting would make the
    host wait for the previous step's graph, a hidden synchronisation).

    ``regions`` batches share it side by side (a stepped batch's steps): each
    fills and is checked in its own region, and one copy moves them all.
    """

    def __init__(
        self, layout: StagingLayout, device: torch.device, *, static: bool, regions: int = 1
    ) -> None:
        self.layout = layout
        self.device = device
        self.static = static
        self.regions = regions
        self.copies = 0
        self.device_buf: torch.Tensor | None = None
        self._size = max(layout.size, 1)
        self._pinned = device.type == "cuda"
        self._ring: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []
        if static or self._pinned:
            for _ in range(_RING if self._pinned else 1):
                self._ring.append(self._host_buffer(self._size * regions))
        if static:
            self.host, self.host_view = self._ring[0][0], self._ring[0][1]
            self.device_buf = torch.zeros(self._size * regions, dtype=torch.int32, device=device)

    def _host_buffer(self, size: int) -> tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]:
        host = torch.zeros(size, dtype=torch.int32, pin_memory=self._pinned)
        # numpy views made once: .numpy() costs a microsecond and more a call
        return host, host.numpy(), torch.cuda.Event() if self._pinned else None

    def _next_host(self, size: int) -> tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]:
        """The next pinned buffer of the ring, once the copy out of it (``_RING`` calls ago)
        is done; grown when a fresh plan's host pass needs more room."""
        slot = self.copies % len(self._ring)
        host, view, done = self._ring[slot]
        if done is not None and self.copies >= len(self._ring):
            done.synchronize()  # queued behind a few steps' GPU work at most: long finished
        if host.shape[0] < size:
            host, view, done = self._ring[slot] = self._host_buffer(max(size, 2 * host.shape[0]))
        return host, view, done

    def view(self, segment: Segment, n: int) -> torch.Tensor:
        """The first ``n`` staged values of ``segment`` (static stagers only)."""
        return self.device_buf[segment.offset : segment.offset + n]

    def stage(
        self,
        batch: ForwardBatch,
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
        extra: int = 0,
        host_work: Callable[[np.ndarray], None] | None = None,
    ) -> torch.Tensor:
        """Fill, check, ``host_work`` (a fresh plan's host pass, writing its outputs in the
        ``extra`` elements after the inputs), one host-to-device copy, then device-resident
        inputs; the device buffer."""
        return self.stage_all(
            [batch], reqs, tokens, ranges, read_device=read_device, extra=extra, host_work=host_work
        )[0]

    def stage_all(
        self,
        batches: list[ForwardBatch],
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
        extra: int = 0,
        host_work: Callable[[np.ndarray], None] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`stage` for several batches, one region each, in one copy; a view per batch
        (``extra`` and ``host_work`` for a single batch only)."""
        n = len(batches)
        if n > self.regions and self.static:
            raise BatchError(
                "more batches than staging regions", field="steps", expected=self.regions, actual=n
            )
        size = self._size + extra if n == 1 else self._size
        total = size * n
        if self.static:  # fixed size: the ring's buffers as they are
            host, view, done = self._next_host(total)
        elif self._ring:
            host, view, done = self._next_host(total)
            host, view = host[:total], view[:total]
        else:  # fresh on the CPU: the buffer is the plan's own memory, so it is new per call
            host = torch.empty(total, dtype=torch.int32)
            view, done = host.numpy(), None
        pending = []
        for r, batch in enumerate(batches):
            region = view[r * size : (r + 1) * size] if n > 1 else view
            on_device = self.layout.fill(
                region, batch, reqs, tokens, ranges, read_device=read_device
            )
            self.layout.check(region, batch, ranges, on_device)
            pending.append(on_device)
        if host_work is not None:
            host_work(view)
        if not self.static:
            dev = (
                host if done is None else torch.empty(total, dtype=torch.int32, device=self.device)
            )
        else:
            dev = self.device_buf
        if done is None:
            if dev is not host:
                dev.copy_(host)
        else:
            dev.copy_(host, non_blocking=True)
            done.record()
        self.copies += 1
        views = [dev[r * size : (r + 1) * size] for r in range(n)] if n > 1 else [dev]
        for batch, region, on_device in zip(batches, views, pending):
            for seg, tensor in on_device:
                n_real = batch.num_tokens if seg.per_token else batch.bs
                region[seg.offset : seg.offset + n_real].copy_(tensor)
        return views
