"""Raw batch inputs, staged into one host buffer, range-checked once and moved with one copy.

Per-request or per-token inputs (lengths, pool rows, positions, cache
locations) are small; sending each with its own host-to-device copy costs a
launch and a driver call apiece. They are written side by side into one int32
host buffer, padding rows included, checked against their limits in one
vectorised pass (the only value-range check the planner has), and copied in
one transfer.

This module lays the buffer out and checks it; ``planner.stager`` moves it,
the same way in every phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from planner.batch import SOURCES, ForwardBatch
from planner.door import check_table_width
from planner.errors import BatchError
from planner.value_checks import check_positions, check_table_entries, check_unique

_FIELD_OF_SOURCE = {"seq_lens": "seq_lens_cpu", "extend_lens": "extend_lens_cpu"}
_UNCHECKED = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
_NONE: frozenset = frozenset()
_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
_BOUNDS_KEPT = 64
"""Bounds arrays kept per layout, for uniform batches (one key per batch size, on the replay
hot path). Ragged batches' are not kept: their key is their token count, so a cache would
grow with traffic, and they are planned eagerly anyway."""


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
        self._first: dict[str, Segment] = {}
        for seg in self._order:
            self._first.setdefault(seg.source, seg)
        self._relation = (
            self.segments.get(("extend_lens", pad_of(wanted, "extend_lens"))),
            self.segments.get(("seq_lens", pad_of(wanted, "seq_lens"))),
        )
        self._bounds: dict[tuple, tuple[np.ndarray, np.ndarray, Ranges]] = {}

    def _bounds_for(
        self, reqs: int, tokens: int, ranges: Ranges, skip: frozenset, *, keep: bool = True
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
            bounds = (lo, hi, ranges)  # ranges kept alive: its id is part of the key
            if keep:
                if len(self._bounds) >= _BOUNDS_KEPT:
                    del self._bounds[next(iter(self._bounds))]  # the oldest
                self._bounds[key] = bounds
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
        ragged = batch.extend_lens_cpu is not None
        counts = (batch.bs, batch.num_tokens)  # num_tokens sums the extend lengths: once
        lo, hi = self._bounds_for(*counts, ranges, skip, keep=not ragged)
        flat = host[: self.size]
        bad = (flat < lo) | (flat > hi)
        if not bad.any():
            self._check_relations(host, batch, skip, counts)
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

    def _real(
        self, host: np.ndarray, source: str, skip: frozenset, counts: tuple[int, int]
    ) -> np.ndarray | None:
        """The real (unpadded) staged values of ``source`` (``counts``: the batch's requests
        and tokens), or None where it is not staged here."""
        seg = self._first[source]
        if seg.offset in skip:
            return None
        return host[seg.offset : seg.offset + counts[seg.per_token]]

    def _check_relations(
        self, host: np.ndarray, batch: ForwardBatch, skip: frozenset, counts: tuple[int, int]
    ) -> None:
        """After the ranges: no KV slot written twice, no request twice, and given positions
        equal to what the lengths imply (``planner.value_checks``)."""
        slots = self._real(host, "out_cache_loc", skip, counts)
        if slots is not None:
            check_unique("out_cache_loc", slots, "a KV slot written")
        pools = self._real(host, "req_pool_indices", skip, counts)
        if pools is not None:
            check_unique("req_pool_indices", pools, "a request")
        if batch.positions is not None:
            positions = self._real(host, "positions", skip, counts)
            if positions is not None:
                lens = self._real(host, "seq_lens", frozenset(), counts)  # always host values
                new = batch.extend_lens_cpu
                if new is not None:
                    new = new.numpy()
                elif batch.next_n > 1:
                    new = np.full(lens.size, batch.next_n)
                check_positions(positions, lens, new)

    def check_table(self, host: np.ndarray, batch: ForwardBatch, ranges: Ranges) -> None:
        """The token table entries the plans read, in ``[0, kv_slots)``: a device read where
        the table is on the device, so only where ``read_device`` allows it."""
        counts = (batch.bs, 0)
        pools = self._real(host, "req_pool_indices", frozenset(), counts)
        lens = self._real(host, "seq_lens", frozenset(), counts)
        check_table_entries(batch.req_to_token, pools, lens, ranges.kv_slots)

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
