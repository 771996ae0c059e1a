"""When a ring's pinned buffers may be refilled: one CUDA event per few copies, not per copy.

Why: each staging copy recorded an event, and the next fill of its buffer waited on that
event: two driver calls of about 3 us each on the H200's host (r10-1), a fifth of a replay.
Copies queued on one stream run in order, so one event recorded after the last of a group
of copies says that all of them ran. The ring therefore records an event after every
``GROUP`` copies, on the stream those copies went to. A copy queued on another stream than
the ones before it closes their group first, with an event on their stream. A buffer is
refilled once the event covering the copy that last read it has completed; each recorded
event is waited on at most once.

A ring of ``size`` buffers must hold ``GROUP`` of them at least: the copy that last read a
buffer is then covered before the buffer comes round again. A ring of ``RING + GROUP - 1``
buffers waits on a copy as many steps back as a ring of ``RING`` buffers with one event
per copy does.
"""

from __future__ import annotations

import torch

from planner.cuda_events import current_stream_ids, record_on_current_stream, record_on_stream

GROUP = 4
"""Copies one event covers (at most: a change of stream closes a group early)."""


class RingEvents:
    """The events of one ring of ``size`` pinned buffers on CUDA device ``device_index``:
    :meth:`before_fill` before writing the buffer of copy ``n``, :meth:`after_copy` once
    copy ``n`` out of it is queued."""

    def __init__(self, size: int, device_index: int) -> None:
        if size < GROUP:
            raise ValueError(f"a ring of {size} buffers is smaller than a group ({GROUP})")
        self.size = size
        self.device_index = device_index
        self._events = [torch.cuda.Event() for _ in range(size)]
        self._cover = [(-1, -1)] * size
        """Per buffer: (the buffer whose event covers its last copy, that event's copy)."""
        self._waited = [-1] * size
        """Per event: the copy it was last recorded after, once waited on."""
        self._pending: list[tuple[int, int]] = []
        """(buffer, copy) of the copies queued since the last event, all on ``_stream``."""
        self._stream: tuple[int, int, int] | None = None
        self.recorded = 0
        self.waits = 0

    def before_fill(self, n: int) -> None:
        """Return once buffer ``n % size`` may be refilled for copy ``n``: the copy that read it
        last (``n - size``) has run."""
        if n < self.size:
            return
        owner, copy = self._cover[n % self.size]
        if copy < 0:  # never sent (a fill that was not sent leaves nothing to wait for)
            return
        if self._waited[owner] != copy:
            self._events[owner].synchronize()
            self._waited[owner] = copy
            self.waits += 1

    def after_copy(self, n: int) -> None:
        """Copy ``n`` out of buffer ``n % size`` is queued on the current stream."""
        ids = current_stream_ids(self.device_index)
        if self._pending and ids != self._stream:
            self._close()  # their stream's event: this copy's stream says nothing of theirs
        self._stream = ids
        self._pending.append((n % self.size, n))
        # a torch that cannot name its streams: an event per copy, on the current stream
        if len(self._pending) >= GROUP or ids is None:
            self._close()

    def _close(self) -> None:
        """Record one event after the pending copies, on their stream; it covers them all."""
        owner, copy = self._pending[-1]
        if self._stream is None:
            record_on_current_stream(self._events[owner], self.device_index)
        else:
            record_on_stream(self._events[owner], self._stream)
        self._waited[owner] = -1
        for buffer, _ in self._pending:
            self._cover[buffer] = (owner, copy)
        self._pending.clear()
        self.recorded += 1
