"""Raw batch inputs, staged into one host buffer, range-checked once and moved with one copy.

Per-request or per-token inputs (lengths, pool rows, positions, cache locations) are small;
sending each with its own host-to-device copy costs a launch and a driver call apiece. They
are written side by side into one int32 host buffer, padding rows included, checked against
their limits in one vectorised pass (the only value-range check the planner has), and moved
to the device in one transfer, the same way in every phase.

How the filled host buffer reaches the device is a :class:`Transport`: by default
:class:`CopyTransport`, one asynchronous copy out of pinned memory. A graph runner may stage
another way, e.g. have the captured graph pull the buffer itself (``graphs.staging_pull``):
the planner calls the transport's :meth:`~Transport.record` inside the capture, before any op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from planner.batch import SOURCES, ForwardBatch, implied_positions
from planner.checks import (
    ElementBounds,
    all_distinct,
    check_positions,
    check_table_entries,
    check_table_width,
    check_unique,
    uniform_positions,
)
from planner.errors import BatchError

_FIELD_OF_SOURCE = {"seq_lens": "seq_lens_cpu", "extend_lens": "extend_lens_cpu"}
_NONE: frozenset = frozenset()
_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
_I32 = np.dtype(np.int32)
_ATTR = {
    "seq_lens": "seq_lens_cpu",
    "req_pool_indices": "req_pool_indices",
    "out_cache_loc": "out_cache_loc",
    "positions": "positions",
}
"""The batch attribute each source is read from as it is; the others (extend lengths, and
positions the engine left out) go through ``ForwardBatch.source``."""
_BOUNDS_KEPT = 64
"""Bounds arrays kept per layout: one per captured (requests, tokens) bucket, on the replay
hot path, and per size of eager uniform plans. An eager ragged plan's are not kept: their
key is its token count, so a cache would grow with traffic (it pays the two-comparison pass)."""


@dataclass(frozen=True)
class Ranges:
    """Inclusive ``(lo, hi)`` of each staged input; hashable, so bounds are cached per value."""

    seq_lens: tuple[int, int]
    extend_lens: tuple[int, int]
    req_pool_indices: tuple[int, int]
    out_cache_loc: tuple[int, int]
    positions: tuple[int, int]
    max_context: int
    kv_slots: int | None = None

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
        kv_slots=kv_slots,
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
        self.sources = wanted  # every (source, pad) staged, in order: what packed() lays out
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
        self._first_offsets: dict[str, int] = {}
        """Where the first segment of each source starts (what the relation checks read)."""
        for seg in self._order:
            self._first_offsets.setdefault(seg.source, seg.offset)
        self._relation = (
            self.segments.get(("extend_lens", pad_of(wanted, "extend_lens"))),
            self.segments.get(("seq_lens", pad_of(wanted, "seq_lens"))),
        )
        self._bounds: dict[tuple, ElementBounds] = {}
        self._fills = tuple(
            (seg, seg.offset, seg.per_token, seg.pad, _ATTR.get(seg.source)) for seg in self._order
        )
        """What ``_fill`` reads of each segment, unpacked once, with the batch attribute its
        source is read from (None: derived, or written as a constant)."""

    def packed(self, reqs: int, tokens: int) -> StagingLayout:
        """The same segments, in the same order, sized for a bucket of ``reqs`` requests and
        ``tokens`` tokens: a captured bucket's batches stage into this, so the fill, the
        range pass and the copy touch the bucket's elements, not the mode's capacity."""
        return StagingLayout(self.sources, reqs, tokens)

    def fill_checked(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool,
        static: bool = False,
    ) -> list[tuple[Segment, torch.Tensor]]:
        """Fill, :meth:`check` and (``read_table``) :meth:`check_table` one batch's region;
        the device-resident inputs left for after the copy. ``static``: a captured bucket
        of ``reqs`` and ``tokens`` (few: its range bounds are kept)."""
        counts = real_counts(batch)
        on_device = self._fill(host, batch, reqs, tokens, ranges, read_device, counts)
        self.check(host, batch, ranges, on_device, counts, (reqs, tokens) if static else None)
        if read_table:
            self.check_table(host, batch, ranges)
        return on_device

    def _bounds_for(
        self, reqs: int, tokens: int, ranges: Ranges, skip: frozenset, *, keep: bool = True
    ) -> tuple[ElementBounds, tuple[bool, ...]]:
        """The bounds of the first ``reqs`` / ``tokens`` elements of each segment, and the
        ``per_token`` of each checked segment whose pad is outside its range (the padding
        rows of a bucket's bounds that are outside by design)."""
        key = (reqs, tokens, id(ranges), skip)  # ranges are cached per planner: ids are stable
        found = self._bounds.get(key)
        if found is None:
            lo = np.full(self.size, _INT32[0], dtype=np.int64)
            hi = np.full(self.size, _INT32[1], dtype=np.int64)
            pads_outside = []
            for seg in self._order:
                if seg.offset in skip:
                    continue
                n, (low, high) = tokens if seg.per_token else reqs, ranges[seg.source]
                lo[seg.offset : seg.offset + n], hi[seg.offset : seg.offset + n] = low, high
                if not low <= seg.pad <= high:
                    pads_outside.append(seg.per_token)
            # ranges kept alive: its id is part of the key; bounds used once are not worth
            # the one-pass arrays
            found = ElementBounds(lo, hi, ranges, one_pass=keep), tuple(pads_outside)
            if keep:
                if len(self._bounds) >= _BOUNDS_KEPT:
                    del self._bounds[next(iter(self._bounds))]  # the oldest
                self._bounds[key] = found
        return found

    def _fill(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        reqs: int,
        tokens: int,
        ranges: Ranges,
        read_device: bool,
        counts: tuple[int, int],
    ) -> list[tuple[Segment, torch.Tensor]]:
        """Write each source, then its pad, into ``host``; return the device-resident ones left.

        A device-resident input cannot be written from the host without a read; with
        ``read_device`` (eager and debug) it is read, staged and checked like a host one,
        otherwise it is returned as (segment, tensor) for a device-to-device copy after the
        transfer. Extend lengths a uniform batch leaves out are written as the constant they
        are, and positions it leaves out as the lengths imply them, with no tensor made for
        either. ``counts`` are :func:`real_counts`.
        """
        on_device: list[tuple[Segment, torch.Tensor]] = []
        real_reqs, real_tokens = counts
        implied = None if batch.extend_lens_cpu is not None else batch.next_n
        constant = implied is not None and batch.extend_lens is None
        for seg, start, per_token, pad, attr in self._fills:
            if per_token:
                mid, end = start + real_tokens, start + tokens
            else:
                mid, end = start + real_reqs, start + reqs
            value = getattr(batch, attr) if attr is not None else None
            if value is None:
                if constant and seg.source == "extend_lens":
                    host[start:mid] = implied  # the constant it is: no tensor made
                elif seg.source == "positions":  # left out: what ForwardBatch.source derives
                    _derive_positions(batch, implied, host[start:mid])
                else:
                    value = batch.source(seg.source)  # device extend lengths, a draft extend's
            if value is not None:
                if value.is_cpu:
                    values = value.numpy()
                elif value.is_cuda and not read_device:
                    on_device.append((seg, value))
                    values = None
                else:
                    values = value.cpu().numpy()
                if values is not None:
                    if values.dtype is not _I32 and values.size:
                        _fits_int32(seg.source, values, ranges)
                    host[start:mid] = values
            if end > mid:
                host[mid:end] = pad
        return on_device

    def check(
        self,
        host: np.ndarray,
        batch: ForwardBatch,
        ranges: Ranges,
        on_device: list[tuple[Segment, torch.Tensor]],
        counts: tuple[int, int] | None = None,
        bucket: tuple[int, int] | None = None,
    ) -> None:
        """Every staged input within its range, in one vectorised pass over ``host``.

        The one relation between inputs, no request adding more tokens than its KV length
        holds (a negative cached prefix), is named before any other error. Staged positions
        imply it (the first of such a request would be negative: out of range, derived, or
        unequal to its given value), so it is looked at only on the way to an error, or
        where the positions are not checked here (on the device).

        The pass runs over the ``bucket`` (padded requests and tokens) whose bounds are
        kept, so a ragged replay reuses them as a uniform one does: each padding row holds
        its segment's pad, so exactly the padding rows of pads outside their range are
        outside, and only more than those is an error. Bounds of the real rows alone (not
        kept where the counts change every batch: an eager ragged plan) name it.
        """
        skip = frozenset(seg.offset for seg, _ in on_device) if on_device else _NONE
        # without extend lengths, implied by the mode: seq_lens' range covers the relation
        given = batch.extend_lens_cpu is not None
        if given and self._first_offsets["positions"] in skip:
            self._check_prefix(host, batch.bs, skip)
        counts = counts or real_counts(batch)
        reqs, tokens = bucket or counts
        keep = not given or bucket is not None
        bounds, pads_outside = self._bounds_for(reqs, tokens, ranges, skip, keep=keep)
        padding = 0
        for per_token in pads_outside:
            padding += tokens - counts[1] if per_token else reqs - counts[0]
        flat = host[: self.size]
        if not bounds.outside(flat, padding):
            try:
                return self._check_relations(host, batch, skip, counts)
            except BatchError:
                if given:
                    self._check_prefix(host, batch.bs, skip)
                raise
        if given:
            self._check_prefix(host, batch.bs, skip)
        if (reqs, tokens) != counts:
            bounds = self._bounds_for(*counts, ranges, skip, keep=False)[0]
        index = bounds.first_outside(flat)
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

    def _check_relations(
        self, host: np.ndarray, batch: ForwardBatch, skip: frozenset, counts: tuple[int, int]
    ) -> None:
        """After the ranges: no KV slot written twice, no request twice, and given positions
        equal to what the lengths imply (``planner.checks``)."""
        reqs, tokens = counts
        at = self._first_offsets  # sources are staged once each at least: offsets are known
        slots, pools, positions = at["out_cache_loc"], at["req_pool_indices"], at["positions"]
        slots = None if slots in skip else host[slots : slots + tokens]
        pools = None if pools in skip else host[pools : pools + reqs]
        if slots is None or pools is None or not all_distinct(slots, pools):
            if slots is not None:  # which repeats, and is it more than the null 0
                check_unique("out_cache_loc", slots, "a KV slot written")
            if pools is not None:
                check_unique("req_pool_indices", pools, "a request")
        if batch.positions is not None and positions not in skip:
            lens = at["seq_lens"]  # always host values
            new = batch.extend_lens_cpu
            if new is not None:
                new = new.numpy()
            elif batch.next_n > 1:
                new = batch.next_n  # the same count for every request: no array made
            check_positions(host[positions : positions + tokens], host[lens : lens + reqs], new)

    def check_table(self, host: np.ndarray, batch: ForwardBatch, ranges: Ranges) -> None:
        """The token table entries the plans read, in ``[0, kv_slots)``: a device read where
        the table is on the device, so only where ``read_device`` allows it."""
        reqs, at = batch.bs, self._first_offsets
        pools, lens = at["req_pool_indices"], at["seq_lens"]
        pools, lens = host[pools : pools + reqs], host[lens : lens + reqs]
        check_table_entries(batch.req_to_token, pools, lens, ranges.kv_slots)

    def _check_prefix(self, host: np.ndarray, reqs: int, skip: frozenset) -> None:
        extend, seq = self._relation
        if extend is None or seq is None or extend.offset in skip or seq.offset in skip:
            return
        new = host[extend.offset : extend.offset + reqs]
        kv = host[seq.offset : seq.offset + reqs]
        longer = new > kv
        if longer.any():
            i = int(longer.argmax())
            raise BatchError(
                "a request adds more tokens than its KV length (negative cached prefix)",
                field="extend_lens_cpu",
                expected=f"<= seq_lens_cpu[{i}] = {int(kv[i])}",
                actual=int(new[i]),
            )


def real_counts(batch: ForwardBatch) -> tuple[int, int]:
    """The batch's real requests and query tokens: the door checked that ``out_cache_loc``
    holds one slot per token, so its length is ``num_tokens`` without summing the lengths."""
    return batch.bs, batch.out_cache_loc.shape[0]


def _derive_positions(batch: ForwardBatch, implied: int | None, out: np.ndarray) -> None:
    """Positions a batch left out, as ``ForwardBatch.source`` derives them, written into
    ``out`` (no tensor made and read back): ``implied`` tokens per request of a uniform
    batch, else each request's extend length."""
    lens = batch.seq_lens_cpu.numpy()
    if implied is not None:
        uniform_positions(lens, implied, out)
    else:
        out[:] = implied_positions(lens, batch.extend_lens_cpu.numpy())


def pad_of(sources: list[tuple[str, int]], name: str) -> int:
    """The pad of the first segment of source ``name`` (what the relation check compares)."""
    return next((pad for source, pad in sources if source == name), 0)


def _fits_int32(source: str, values: np.ndarray, ranges: Ranges) -> None:
    """int64 inputs are staged as int32: a value past int32 would wrap into a valid-looking one.

    Screened with one reduction (where the minimum and the maximum cost two): values
    all in ``[0, 2**31)``, the usual case, have their bitwise or there too, and fit. Only
    otherwise are the minimum and maximum read, to refuse a value past int32 (a negative
    one that fits is left to the range pass, which names it).
    """
    if int(np.bitwise_or.reduce(values)) >> 31 == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < _INT32[0] or high > _INT32[1]:
        lo, hi = ranges[source]
        raise BatchError(
            "value out of range",
            field=_FIELD_OF_SOURCE.get(source, source),
            expected=f"[{lo}, {hi}]",
            actual=low if low < _INT32[0] else high,
        )


class Transport(Protocol):
    """How a stager's filled host buffer reaches its device buffer (see the module docstring).

    The planner asks for a host buffer, fills and checks it, then sends it; inside a graph
    capture it calls :meth:`record` before any op, and after each graph launch of a replay
    :meth:`launched`. ``name`` says which transport it is, for reports.
    """

    name: str

    def host(self, size: int, *, now: bool) -> tuple[torch.Tensor, np.ndarray]:
        """A host buffer of ``size`` int32 elements, free to fill, and its numpy view.
        ``now``: what is sent is read before any graph runs (a capture's ops, a host op of a
        replay that reads the staged inputs), so it must reach the device at :meth:`send`."""
        ...

    def send(self, host: torch.Tensor, dev: torch.Tensor, size: int, *, now: bool) -> None:
        """The first ``size`` elements of ``host`` (the buffer :meth:`host` gave) into ``dev``."""
        ...

    def record(self, dev: torch.Tensor, *, first: bool) -> None:
        """Called by ``Planner.record`` before the graph's ops: what the graph itself does to
        stage into ``dev``. ``first``: the call of the capture (an emulated graph runs its
        body at capture too, and at every replay)."""
        ...

    def launched(self) -> None:
        """The graph of the last replay staged through this transport was launched."""
        ...


class CopyTransport:
    """The one host-to-device copy of a staged buffer, out of pinned memory on CUDA.

    Each send fills a pinned buffer of torch's caching host allocator and drops it after the
    asynchronous copy: the allocator records the copy's event and hands that memory out again
    only once the copy has run, so no later fill can race the copy, and nothing here waits
    for the GPU (a wait would make the host wait for the GPU work queued before the copy, a
    hidden synchronisation). On the CPU a plain buffer, copied only where the destination is
    another tensor.
    """

    name = "copy"

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self.copies = 0

    def host(self, size: int, *, now: bool = True) -> tuple[torch.Tensor, np.ndarray]:
        host = torch.empty(size, dtype=torch.int32, pin_memory=self.pinned)
        return host, host.numpy()

    def send(self, host: torch.Tensor, dev: torch.Tensor, size: int, *, now: bool = True) -> None:
        if dev.shape[0] != size:
            dev = dev[:size]
        if self.pinned:
            dev.copy_(host, non_blocking=True)
        elif dev is not host:
            dev.copy_(host)
        self.copies += 1

    def record(self, dev: torch.Tensor, *, first: bool) -> None:
        """The copy happens before the graph's launch: nothing to record in it."""

    def launched(self) -> None:
        """Nothing follows a launch: the copy was made at the replay."""


TransportFactory = Callable[[int, torch.device, str], Transport]
"""``factory(words, device, mode)``: the transport of one mode's static stager, whose
device buffer holds ``words`` int32 elements (``graphs.PulledTransport`` is one)."""


class Stager:
    """Stages batches into one device buffer with one transfer; see the module docstring.

    A static stager (capture and replay) owns a device buffer for the planner's life;
    ``regions`` batches share it side by side (a draft decode's steps), each filled and
    checked in its own region, all sent at once. A fresh one (eager plans) stages into a
    new device buffer per plan, with room for ``device_extra`` elements after the staged
    ones (the plan's int32 fields computed on the device: one allocation per plan); on
    the CPU that buffer is the host buffer itself.
    """

    def __init__(
        self,
        layout: StagingLayout,
        device: torch.device,
        transport: Transport,
        *,
        static: bool,
        regions: int = 1,
    ) -> None:
        self.layout, self.device, self.transport = layout, device, transport
        self.static, self.regions = static, regions
        self.size = max(layout.size, 1)
        """int32 elements of one batch's inputs (a region)."""
        self.device_buf = (
            torch.zeros(self.size * regions, dtype=torch.int32, device=device) if static else None
        )
        self._buckets: dict[tuple[int, int], StagingLayout] = {}

    def layout_for(self, reqs: int, tokens: int) -> StagingLayout:
        """The layout a batch padded to ``reqs`` requests and ``tokens`` tokens stages in: a
        static stager's own per bucket (buckets are few), a fresh stager's one layout."""
        if not self.static:
            return self.layout
        layout = self._buckets.get((reqs, tokens))
        if layout is None:
            layout = self._buckets[(reqs, tokens)] = self.layout.packed(reqs, tokens)
        return layout

    def stage(
        self,
        batches: Sequence[ForwardBatch],
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool = False,
        now: bool = True,
        extra: int = 0,
        host_work: Callable[[np.ndarray], None] | None = None,
        device_extra: int = 0,
    ) -> list[torch.Tensor]:
        """Fill and check each batch's region, ``host_work(view)`` (a fresh plan's host pass,
        writing its outputs in the ``extra`` elements after the inputs), one transfer, then
        the device-resident inputs; the device region of each batch.

        ``read_device`` reads device-resident inputs to stage and check them (eager plans and
        debug mode), else they are copied on the device after the transfer; ``read_table``
        also checks the token table entries the plans read (``planner.checks``); ``now``:
        the device buffer is read before any graph runs (see :meth:`Transport.host`)."""
        n = len(batches)
        if n > self.regions and self.static:
            raise BatchError(
                "more batches than staging regions", field="steps", expected=self.regions, actual=n
            )
        layout = self.layout_for(reqs, tokens)
        size = self.size + extra if n == 1 else self.size
        # the last region ends where its bucket's inputs end: a single batch sends only those
        total = size * (n - 1) + (layout.size if self.static else size)
        fresh_on_host = not self.static and self.device.type == "cpu"
        if fresh_on_host:  # the plan's own memory, filled in place
            host = torch.empty(total + device_extra, dtype=torch.int32)
            view = host.numpy()[:total]
        else:
            host, view = self.transport.host(total, now=now)
        pending = []
        for r, batch in enumerate(batches):
            region = view[r * size : (r + 1) * size] if n > 1 else view
            pending.append(
                layout.fill_checked(
                    region,
                    batch,
                    reqs,
                    tokens,
                    ranges,
                    read_device=read_device,
                    read_table=read_table,
                    static=self.static,
                )
            )
        if host_work is not None:
            host_work(view)
        if self.static:
            dev = self.device_buf
        elif fresh_on_host:
            dev = host
        else:
            dev = torch.empty(total + device_extra, dtype=torch.int32, device=self.device)
        if dev is not host:
            self.transport.send(host, dev, total, now=now)
        views = [dev[r * size : (r + 1) * size] for r in range(n)] if n > 1 else [dev]
        for region, batch, on_device in zip(views, batches, pending):
            if on_device:
                counts = real_counts(batch)
                for seg, tensor in on_device:
                    region[seg.offset : seg.offset + counts[seg.per_token]].copy_(tensor)
        return views
