"""How a step's raw inputs reach the device: a ring of host slots, one transfer per step.

A captured mode's :class:`Stager` owns the device buffer its graphs read the raw inputs from
and, through its :class:`Transport`, a ring of host slots (pinned on CUDA) the engine writes
each step into (``planner.step_inputs``). A replay sends the slot in one transfer; the device
then checks, pads and derives (``planner.device_checks``). Nothing on the host reads the
values: the host's part of a step is the engine's writes and one submission.

By default the transfer is :class:`CopyTransport`, one asynchronous copy out of the slot. A
graph runner may stage another way, e.g. have the captured graph pull the slot itself
(``graphs.staging_pull``): the planner calls the transport's :meth:`~Transport.record` inside
the capture, before any op. Either way a slot is handed out again only once the transfer that
read it has run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from planner.batch import ForwardMode
from planner.device_checks import Bounds
from planner.step_inputs import InputLayout, StepInputs


def input_bounds(
    mode: ForwardMode,
    max_context: int,
    next_n: int,
    kv_slots: int | None,
    table: torch.Tensor,
    kv_bound: int | None = None,
) -> Bounds:
    """What a batch of ``mode`` may hold for a planner's limits and token table.

    A uniform batch adds exactly ``next_n`` tokens per request (1 in decode); a ragged one at
    least one, and never more than the request's KV length; a draft extend 1..``next_n``,
    its rows past them padding. ``kv_bound``: a captured ragged bucket's bound on the KV."""
    given = mode.ragged or mode.padded_rows
    extend = (1, max_context if mode.ragged else next_n) if given else (next_n, next_n)
    return Bounds(
        ranges={  # inclusive (lo, hi) of each input
            "seq_lens": (extend[0], min(max_context, table.shape[1])),
            "extend_lens": extend,
            "req_pool_indices": (0, table.shape[0] - 1),
            "out_cache_loc": (0, (kv_slots if kv_slots is not None else 2**31) - 1),
            "positions": (0, max_context - 1),
        },
        max_context=max_context,
        table_width=table.shape[1],
        kv_slots=kv_slots,
        tokens_given=given,
        kv_bound=kv_bound,
    )


class Transport(Protocol):
    """How a stager's host slots reach its device buffer (see the module docstring).

    ``slots`` are the host buffers, each of the stager's words; the planner asks
    :meth:`take` for the index of the one to write next, then :meth:`send`\\ s it. Inside a
    graph capture it calls :meth:`record` before any op, and after each graph launch of a
    replay :meth:`launched`. ``name`` says which transport it is, for reports.
    """

    name: str
    slots: Sequence[torch.Tensor]

    def take(self) -> int:
        """The slot the next step writes: no transfer still reads it."""
        ...

    def send(self, index: int, dev: torch.Tensor, *, now: bool) -> None:
        """Slot ``index`` into ``dev``. ``now``: something reads ``dev`` before any graph runs
        (a capture's ops, a host op of a replay), so it must be there at once."""
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
    """Two host slots, each sent with one asynchronous copy (out of pinned memory on CUDA).

    A slot is handed out again only once its last copy has run (its event; by then, in a
    loop that reads each step's outputs, always): no write can race a copy, and nothing
    waits for the GPU's other work."""

    name = "copy"
    SLOTS = 2

    def __init__(
        self, words: int, device: torch.device, *, events: Callable[[], Any] | None = None
    ) -> None:
        """``events``: what makes each slot's event (``torch.cuda.Event`` on CUDA, none on
        the CPU, whose copies are done when they return; a test's delayed device)."""
        pinned = device.type == "cuda"
        self.slots = [
            torch.zeros(words, dtype=torch.int32, pin_memory=pinned) for _ in range(self.SLOTS)
        ]
        if events is None and pinned:
            events = torch.cuda.Event
        self._events = [events() if events is not None else None for _ in range(self.SLOTS)]
        self._next = 0
        self.copies = 0

    def take(self) -> int:
        event = self._events[self._next]
        if event is not None:
            event.synchronize()
        return self._next

    def send(self, index: int, dev: torch.Tensor, *, now: bool = True) -> None:
        host = self.slots[index]
        event = self._events[index]
        dev.copy_(host, non_blocking=host.is_pinned())
        if event is not None:
            event.record()
        self._next = (index + 1) % self.SLOTS
        self.copies += 1

    def record(self, dev: torch.Tensor, *, first: bool) -> None:
        """The copy happens before the graph's launch: nothing to record in it."""

    def launched(self) -> None:
        """Nothing follows a launch: the copy was made at the replay."""


TransportFactory = Callable[[int, torch.device, str], Transport]
"""``factory(words, device, mode)``: the transport of one mode's stager, whose device buffer
holds ``words`` int32 elements (``graphs.PulledTransport`` is one)."""


class Stager:
    """One captured mode's raw inputs: the device buffer its graphs read, ``regions`` batches
    side by side (a draft decode's steps), and the typed views of each host slot."""

    def __init__(
        self,
        layout: InputLayout,
        device: torch.device,
        transport: Transport,
        mode: ForwardMode,
        regions: int = 1,
    ) -> None:
        self.layout, self.transport, self.regions, self.mode = layout, transport, regions, mode
        self.words = layout.size * regions
        self.device_buf = torch.zeros(self.words, dtype=torch.int32, device=device)
        self.device_regions = [self.region(self.device_buf, r) for r in range(regions)]
        self.views = [
            [StepInputs(self.region(slot, r), layout, mode) for r in range(regions)]
            for slot in transport.slots
        ]
        """Each slot's regions as :class:`StepInputs`, made once."""
        self._taken: int | None = None
        self.steps = 0
        """Slots sent so far: the step number the next send names."""

    def region(self, buffer: torch.Tensor, r: int) -> torch.Tensor:
        size = self.layout.size
        return buffer[r * size : (r + 1) * size]

    def inputs(self) -> list[StepInputs]:
        """The regions of the slot the next step writes (the same until it is sent)."""
        if self._taken is None:
            self._taken = self.transport.take()
            for view in self.views[self._taken]:
                view.sent = None
        return self.views[self._taken]

    def send(self, *, now: bool) -> None:
        """The slot written since :meth:`inputs` into the device buffer."""
        index = self._taken if self._taken is not None else self.transport.take()
        self._taken = None
        self.transport.send(index, self.device_buf, now=now)
        for view in self.views[index]:
            view.sent = (index, self.steps)  # written again only once handed out anew
        self.steps += 1
