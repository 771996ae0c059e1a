"""The stager: one batch's inputs (or a stepped batch's) into the device in one copy.

A static stager (capture and replay) keeps a ring of pinned host buffers
and one device buffer for the planner's life. A fresh one (eager plans)
copies into the plan's own device buffer (new, or a dropped plan's taken back by
``planner.fresh_pool``), from a ring of pinned host buffers
on CUDA (a pageable copy costs several times a pinned one), after the host
pass has added its outputs. Either way a pinned buffer is refilled only once
the copy out of it is done, so two batches never race on one. What is
written where, and the range check, are ``planner.staging``'s.

Where the planner stages in the graph, a static stager also keeps the ring its graphs pull
from (``planner.staging_pull``): the replay lane fills a slot of it and sends nothing; any
other send tells the pull that its step went by the copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from planner import device_copy
from planner.batch import ForwardBatch
from planner.errors import BatchError
from planner.lane_submit import COPY_FAILED, LAUNCH_FAILED, REFUSED, SUBMITTED, LaneSubmit, failed
from planner.ring_events import GROUP, RingEvents
from planner.staging import Ranges, Segment, StagingLayout, real_counts
from planner.staging_pull import PulledRing

_CUTS_KEPT = 64
"""Sizes whose cuts a fresh stager keeps per pinned buffer (ragged batches vary in size)."""
RING = 5 + GROUP - 1
"""Pinned host buffers a stager cycles through: a step fills one while the copies of the
last few may still be queued behind their graphs, so it never waits for them. With one
event per ``GROUP`` copies (``planner.ring_events``), a fill waits at most on the copy
five steps back."""


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
        self,
        layout: StagingLayout,
        device: torch.device,
        *,
        static: bool,
        regions: int = 1,
        appendix: int = 0,
        pulled: str | None = None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.static = static
        self.regions = regions
        self.copies = 0
        self.device_buf: torch.Tensor | None = None
        self.appendix_at = _even(max(layout.size, 1))
        """Where a static stager's appendix starts: int32 elements after the layout's
        inputs (8-byte aligned) that host ops' small outputs live in, sent with them."""
        self._size = self.appendix_at + appendix if appendix else max(layout.size, 1)
        self._pinned = device.type == "cuda"
        self._events: RingEvents | None = None
        if self._pinned:  # one event per few copies, on the device the buffers are sent to
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._events = RingEvents(RING, index)
        self._ring: list[tuple[torch.Tensor, np.ndarray, RingEvents | None]] = []
        self._cuts: dict[int, tuple[torch.Tensor, dict]] = {}
        if static or self._pinned:
            for _ in range(RING if self._pinned else 1):
                self._ring.append(self._host_buffer(self._size * regions))
        if static:
            self.host = self._ring[0][0]  # the first pinned buffer (sizes, benchmarks)
            self.device_buf = torch.zeros(self._size * regions, dtype=torch.int32, device=device)
        self.pull: PulledRing | None = None
        """A static stager's ring that the graph pulls from (``planner.staging_pull``),
        where the planner stages in the graph; ``pulled`` names its mode."""
        if pulled is not None and static:
            self.pull = PulledRing(self._size * regions, device, pulled)

    def region_size(self, extra: int = 0) -> int:
        """Elements one batch's region holds, and one copy sends: the layout's (at least
        one) and ``extra`` after them (a fresh plan's host-pass outputs)."""
        return self._size + extra

    def _host_buffer(self, size: int) -> tuple[torch.Tensor, np.ndarray, RingEvents | None]:
        host = torch.zeros(size, dtype=torch.int32, pin_memory=self._pinned)
        # numpy views made once: .numpy() costs a microsecond and more a call
        return host, host.numpy(), self._events

    def next_host(
        self, size: int | None = None
    ) -> tuple[torch.Tensor, np.ndarray, RingEvents | None]:
        """The next pinned buffer of the ring (``size``: the layout's by default), once the
        copy out of it (``RING`` calls ago) is done; grown when a fresh plan's host pass
        needs more room. Fill it, then :meth:`send` it."""
        if size is None:
            size = self._size
        slot = self.copies % len(self._ring)
        host, view, done = self._ring[slot]
        if done is not None:  # queued behind a few steps' GPU work at most: long finished
            done.before_fill(self.copies)
        if host.shape[0] < size:
            host, view, done = self._ring[slot] = self._host_buffer(max(size, 2 * host.shape[0]))
        return host, view, done

    def _next_cut(self, size: int) -> tuple[torch.Tensor, np.ndarray, RingEvents | None]:
        """:meth:`next_host` cut to ``size`` (a fresh plan's), the cuts kept per buffer: a
        tensor slice costs a few microseconds on a GPU host, and sizes repeat."""
        host, view, done = self.next_host(size)
        cuts = self._cuts.get(id(host))
        if cuts is None or cuts[0] is not host:
            if len(self._cuts) >= 2 * RING:  # buffers regrown: forget the old ones
                self._cuts.clear()
            cuts = self._cuts[id(host)] = (host, {})
        cut = cuts[1].get(size)
        if cut is None:
            if len(cuts[1]) >= _CUTS_KEPT:
                cuts[1].clear()
            cut = cuts[1][size] = (host[:size], view[:size])
        return cut[0], cut[1], done

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
        read_table: bool = False,
        extra: int = 0,
        host_work: Callable[[np.ndarray, int], None] | None = None,
        device_extra: int = 0,
        into: tuple[torch.Tensor, np.ndarray | None] | None = None,
    ) -> torch.Tensor:
        """Fill, check, ``host_work(view, address)`` (a fresh plan's host pass, writing its
        outputs in the ``extra`` elements after the inputs), one host-to-device copy, then device-resident
        inputs; the device buffer."""
        return self.stage_all(
            [batch],
            reqs,
            tokens,
            ranges,
            read_device=read_device,
            read_table=read_table,
            extra=extra,
            host_work=host_work,
            device_extra=device_extra,
            into=into,
        )[0]

    def stage_all(
        self,
        batches: list[ForwardBatch],
        reqs: int,
        tokens: int,
        ranges: Ranges,
        *,
        read_device: bool,
        read_table: bool = False,
        extra: int = 0,
        host_work: Callable[[np.ndarray, int], None] | None = None,
        device_extra: int = 0,
        into: tuple[torch.Tensor, np.ndarray | None] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`stage` for several batches, one region each, in one copy; a view per batch
        (``extra`` and ``host_work`` for a single batch only). A fresh stager's device buffer
        has ``device_extra`` elements more, after the staged ones and never copied: a fresh
        plan's device-computed fields, so that one allocation holds the whole plan. ``into``
        is that buffer where the plan's memory is recycled (``planner.fresh_pool``), with its
        numpy view on the CPU, where it is filled in place."""
        n = len(batches)
        if n > self.regions and self.static:
            raise BatchError(
                "more batches than staging regions", field="steps", expected=self.regions, actual=n
            )
        size = self.region_size(extra) if n == 1 else self._size
        total = size * n
        if self.static:  # fixed size: the ring's buffers as they are
            host, view, done = self.next_host(total)
        else:
            host, view, done = self._fresh_host(total, device_extra, into)
        pending = []
        base = host.data_ptr()
        for r, batch in enumerate(batches):
            region = view[r * size : (r + 1) * size] if n > 1 else view
            counts = real_counts(batch)
            on_device = self.layout.fill_checked(
                region,
                base + 4 * r * size,
                batch,
                reqs,
                tokens,
                ranges,
                read_device=read_device,
                counts=counts,
            )
            if read_table:
                self.layout.check_table(region, batch, ranges)
            pending.append((counts, on_device))
        if host_work is not None:
            host_work(view, base)
        if self.static:
            dev = self.device_buf
        else:
            dev = self._fresh_device(host, done, total, device_extra, into)
        self.send(host, dev, done)
        views = [dev[r * size : (r + 1) * size] for r in range(n)] if n > 1 else [dev]
        for region, (counts, on_device) in zip(views, pending):
            _copy_on_device(region, on_device, counts)
        return views

    def stage_fresh(
        self,
        fill: Callable[[np.ndarray, int], bool],
        batch: ForwardBatch,
        ranges: Ranges,
        *,
        read_table: bool,
        extra: int,
        device_extra: int,
        into: tuple[torch.Tensor, np.ndarray | None] | None,
    ) -> torch.Tensor | None:
        """The eager lane's :meth:`stage` of one host batch (``planner.eager_lane``):
        ``fill(view, address)`` fills and checks the region and runs the host pass (a bound
        compiled screen); None, with nothing sent, where it refuses, and :meth:`stage` must
        run instead."""
        total = self.region_size(extra)
        host, view, done = self._fresh_host(total, device_extra, into)
        if not fill(view, host.data_ptr()):
            return None
        if read_table:
            self.layout.check_table(view, batch, ranges)
        dev = self._fresh_device(host, done, total, device_extra, into)
        self.send(host, dev, done)
        return dev

    def submit_fresh(
        self,
        submit: LaneSubmit,
        args: int,
        table: int,
        redo: Callable[[np.ndarray], None] | None,
        *,
        extra: int,
        device_extra: int,
        into: tuple[torch.Tensor, np.ndarray | None] | None,
    ) -> tuple[torch.Tensor, bool] | None:
        """:meth:`stage_fresh` and the device steps in one C call (``planner.lane_submit``,
        CUDA only): the device buffer, and whether the steps were launched; None, with
        nothing sent, where the screen refuses. Where a host twin declines (``redo`` then
        rewrites the pass in numpy) or a CUDA call fails, the copy is made here and the
        steps are left to the caller."""
        host, view, done = self._fresh_host(self.region_size(extra), device_extra, into)
        dev = self._fresh_device(host, done, host.shape[0], device_extra, into)
        device = done.device_index
        stream = torch._C._cuda_getCurrentRawStream(device)
        status = submit(host.data_ptr(), args, dev.data_ptr(), stream, table)
        if status == SUBMITTED:
            self._sent(done)
            return dev, True
        if status == REFUSED:
            return None
        if status > 0:
            redo(view)
        if status == LAUNCH_FAILED:
            failed(status)
            self._sent(done)  # the copy is queued
            return dev, False
        if status == COPY_FAILED:
            failed(status)
        self.send(host, dev, done)
        return dev, False

    def on_current_device(self) -> bool:
        """Whether this stager copies to a CUDA device that is the current one (what a copy
        or launch queued on the current stream needs)."""
        events = self._events
        return events is not None and torch._C._cuda_getDevice() == events.device_index

    def _fresh_host(
        self, total: int, device_extra: int, into: tuple[torch.Tensor, np.ndarray | None] | None
    ) -> tuple[torch.Tensor, np.ndarray, RingEvents | None]:
        """Where a fresh plan's ``total`` staged elements are filled: the ring's next buffer
        on a GPU; on the CPU the plan's own memory, recycled (``into``) or new."""
        if self._ring:
            return self._next_cut(total)
        if into is not None:
            return into[0], into[1][:total], None
        whole = torch.empty(total + device_extra, dtype=torch.int32)
        return whole, whole.numpy()[:total], None

    def _fresh_device(
        self,
        host: torch.Tensor,
        done: RingEvents | None,
        total: int,
        device_extra: int,
        into: tuple[torch.Tensor, np.ndarray | None] | None,
    ) -> torch.Tensor:
        """A fresh plan's device buffer: the host one on the CPU, else the recycled one, else
        new (the copy fills its first ``total`` elements; the device steps the rest)."""
        if done is None:
            return host
        if into is not None:
            return into[0]
        return torch.empty(total + device_extra, dtype=torch.int32, device=self.device)

    def stage_screened(
        self, batch: ForwardBatch, reqs: int, tokens: int, ranges: Ranges
    ) -> torch.Tensor | None:
        """The replay hot path of a static stager, one batch: the compiled screen fills and
        checks the ring's next buffer, one copy sends it; None (nothing sent) where the
        screen cannot take the batch or refuses it, and :meth:`stage` must run instead."""
        screen = self.layout.screen
        if screen is None or not self.static:
            return None
        host, _view, done = self.next_host(self._size)
        on_device = screen.run(host.data_ptr(), batch, reqs, tokens, ranges, read_device=False)
        if on_device is None:
            return None
        self.send(host, self.device_buf, done)
        if on_device:
            _copy_on_device(self.device_buf, on_device, real_counts(batch))
        return self.device_buf

    def send(self, host: torch.Tensor, dev: torch.Tensor, done: RingEvents | None) -> None:
        """The one host-to-device copy of ``host`` into the start of ``dev`` (asynchronous
        from a pinned buffer, whose event says when it may be refilled; one runtime call,
        ``planner.device_copy``); on the CPU a copy only where the buffers differ."""
        if done is None:
            if dev is not host:
                n = host.shape[0]
                (dev if dev.shape[0] == n else dev[:n]).copy_(host)
        else:
            device_copy.send(dev, host, host.shape[0], done.device_index)
        self._sent(done)

    def _sent(self, done: RingEvents | None) -> None:
        """What follows a queued copy: the ring's event, the count, the pull told."""
        if done is not None:
            done.after_copy(self.copies)
        self.copies += 1
        if self.pull is not None:  # sent already: the graph's pull leaves the buffer alone
            self.pull.publish(sent=True)


def _even(n: int) -> int:
    return n + (n & 1)


def _copy_on_device(
    region: torch.Tensor, on_device: list[tuple[Segment, torch.Tensor]], counts: tuple[int, int]
) -> None:
    """Device-resident inputs into their segments of the staged device buffer, after the copy."""
    for seg, tensor in on_device:
        n_real = counts[seg.per_token]
        region[seg.offset : seg.offset + n_real].copy_(tensor)
