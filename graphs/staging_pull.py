"""The staging copy inside the graph: the captured graph pulls its step's inputs out of a
pinned ring itself, so a replay makes no CUDA call of its own (:class:`PulledTransport`,
the planner's transport of a captured mode: ``Planner(..., transport=PulledTransport)``).

Why: on a GPU host the one host-to-device copy of a replay, and the ring's events, are about
a third of a ``replay()``'s host time, almost all of it the runtime's own submission
(measured before issue 53, `git log -p docs/benchmarks.md`). A graph launch is made anyway; a kernel
inside it can read pinned host memory directly (it is mapped into the device's address
space), so the copy can ride the launch instead of being a second submission.

The protocol. Each mode's static stager has a ring of ``SLOTS`` pinned slots, a device
counter (the steps the graphs have pulled), and a pinned control block: the ack (the
counter as the last pull left it), an error word and one tag per slot.
- ``replay()`` fills slot ``seq % SLOTS`` (``seq``: the graphs launched so far) and writes its
  tag, ``2 * seq`` (or ``2 * seq + 1``: "already sent", where the inputs went by a copy
  because something reads them before the graph runs: a capture's ops, a host op).
- The graph's first kernel (``graphs.staging_pull_kernel``, captured by
  ``Planner.record``) reads the counter, checks that the slot's tag names that step,
  copies the slot unless it was already sent, then advances the counter and the ack.
- ``Planner.graph_launched()``, right after the graph's launch, advances ``seq``.

A slot is refilled only once the ack says its last pull ran (``SLOTS`` launches back), so
the host never writes what a queued graph has still to read. A graph launched without its
``replay()`` finds a tag of another step: it copies nothing and sets the error word, and
the next ``replay()`` raises (the plans of that step were stale) and resynchronises.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from graphs.staging_pull_kernel import pull_kernel
from planner.errors import ReplayError

SLOTS = 8
"""Pinned slots per ring: how many launched graphs the host may run ahead of the GPU."""
_ACK, _ERROR, _TAGS = 0, 1, 2
_BLOCK = 2048
"""int32 words one pass of the pull kernel moves (8 KB of pinned memory per loop step)."""
_SPIN_S = 0.002
"""How long a fill polls the ack before it waits on the device instead."""


def pull_reference(
    block: torch.Tensor, meta: torch.Tensor, counter: torch.Tensor, dst: torch.Tensor
) -> None:
    """What the pull kernel does, in torch: the exact reference the kernel is tested against,
    and the pull of a CPU planner (an emulated graph's replay runs it)."""
    seq = int(counter[0])
    slot = seq % block.shape[0]
    tag = int(meta[_TAGS + slot])
    if tag >> 1 != seq:
        meta[_ERROR] = seq + 1
    elif not tag & 1:
        dst[: block.shape[1]].copy_(block[slot])
    counter[0] = seq + 1
    meta[_ACK] = seq + 1


def _launch(
    block: torch.Tensor, meta: torch.Tensor, counter: torch.Tensor, dst: torch.Tensor
) -> None:
    """The pull kernel over one ring's tensors (pinned ``block`` and ``meta``, device
    ``counter`` and ``dst``), in one program on the current stream."""
    pull_kernel()[(1,)](block, meta, counter, dst, block.shape[1], SLOTS=SLOTS, BLOCK=_BLOCK)


class PulledRing:
    """One static stager's ring of pinned slots, its device counter and its control block;
    see the module docstring. ``mode`` names the ring in errors."""

    def __init__(self, words: int, device: torch.device, mode: str) -> None:
        pinned = device.type == "cuda"
        self.device, self.mode, self.words = device, mode, words
        self.block = torch.zeros((SLOTS, words), dtype=torch.int32, pin_memory=pinned)
        self.meta = torch.zeros(_TAGS + SLOTS, dtype=torch.int64, pin_memory=pinned)
        self.meta[_TAGS:] = -2  # no step's tag: a pull before any fill is an error
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self._meta = memoryview(self.meta.numpy())
        """The control words as Python ints: a third of a numpy scalar's cost to read."""
        self.rows = [self.block[i] for i in range(SLOTS)]
        """Each slot as a tensor made once (the lane keys its cached views on them)."""
        self._views = [row.numpy() for row in self.rows]
        self.seq = 0
        """Graphs launched so far: the step the next fill is for."""
        self.armed = False
        """A tag was written for step ``seq`` and its graph not yet declared launched."""
        self.waits = 0
        if device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile and load the kernel now, on scratch buffers of the ring's shapes (the same
        specialisation): its first launch is inside a graph capture, where loading a module
        is not allowed, and a launch on the ring itself would count a step."""
        _launch(
            torch.zeros_like(self.block).pin_memory(),
            torch.full_like(self.meta, -2).pin_memory(),
            torch.zeros_like(self.counter),
            torch.zeros(self.words, dtype=torch.int32, device=self.device),
        )
        torch.cuda.synchronize(self.device)

    def slot(self) -> tuple[torch.Tensor, np.ndarray]:
        """The slot of step ``seq``, free to fill (its last pull has run); raises first if a
        graph ran without its replay since the last fill."""
        meta, seq = self._meta, self.seq
        if meta[_ERROR]:
            self._refuse()
        if seq >= SLOTS and meta[_ACK] <= seq - SLOTS:
            self._wait_for(seq - SLOTS + 1)
        i = seq % SLOTS
        return self.rows[i], self._views[i]

    def publish(self, *, sent: bool) -> None:
        """Step ``seq``'s slot is filled (``sent``: its inputs already went by a copy, and the
        pull must leave the device buffer alone). A fill for the pull came through
        :meth:`slot`, which checked the error word already; a copy's is checked here."""
        if sent and self._meta[_ERROR]:
            self._refuse()
        seq = self.seq
        self._meta[_TAGS + seq % SLOTS] = 2 * seq + (1 if sent else 0)
        self.armed = True

    def launched(self) -> None:
        """The graph that pulls step ``seq`` was launched."""
        if not self.armed:
            raise ReplayError(
                f"graph_launched() without a replay() of mode {self.mode} since the last launch",
                field="graph_launched",
            )
        self.seq += 1
        self.armed = False

    def pull(self, dst: torch.Tensor) -> None:
        """The graph's pull into ``dst`` (called inside capture on CUDA, where it is recorded;
        an emulated graph calls it at every replay)."""
        pull = _launch if self.device.type == "cuda" else pull_reference
        pull(self.block, self.meta, self.counter, dst)

    def _refuse(self) -> None:
        """The error word is set: resynchronise, then name what happened."""
        error = self._meta[_ERROR]
        found = self._resync()
        raise ReplayError(
            f"a graph of mode {self.mode} ran without its replay(): step {error - 1}'s pull "
            "found no inputs staged for it, so that step ran on stale plans. Every "
            "replay() must be followed by one graph launch and graph_launched(); "
            f"resynchronised at step {found}",
            field="graph_launched",
            expected=f"step {error - 1} staged",
            actual="not staged",
        )

    def _resync(self) -> int:
        """After an error: the host's step count set to the device's, the error cleared."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seq = int(self.counter.item())
        self.armed = False
        self._meta[_ERROR] = 0
        return self.seq

    def _wait_for(self, ack: int) -> None:
        """The host is ``SLOTS`` launches ahead: poll the ack a moment, then wait on the
        device. An ack still short after that means a graph was declared launched that does
        not pull (captured without ``record``, or never launched): refused."""
        self.waits += 1
        deadline = time.perf_counter() + _SPIN_S
        while self._meta[_ACK] < ack and time.perf_counter() < deadline:
            pass
        if self._meta[_ACK] >= ack:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._meta[_ACK] < ack:
            raise ReplayError(
                f"mode {self.mode}'s graphs pulled {int(self._meta[_ACK])} steps, yet "
                f"{self.seq} were declared launched: a graph that does not run the planner's "
                "record() was declared with graph_launched()",
                field="graph_launched",
                expected=f">= {ack} pulls",
                actual=int(self._meta[_ACK]),
            )


class PulledTransport:
    """A captured mode's raw inputs, pulled into its device buffer by its graphs (see the
    module docstring); the planner's ``transport`` for graphs that stage themselves.

    Where the inputs are read before the graph runs (a capture's ops, a host op reading a
    staged field, a device-resident input copied after), they go by a copy instead, and the
    slot's tag says so: the graph's pull then leaves the device buffer alone (it still
    counts the step)."""

    name = "graph"
    in_graph = True
    """It needs every op that reads the staged inputs inside the graph (``ops_in_graph``)."""

    def __init__(self, words: int, device: torch.device, mode: str) -> None:
        self.ring = PulledRing(words, device, mode)
        self.slots = self.ring.rows
        self.pinned = device.type == "cuda"

    def take(self) -> int:
        self.ring.slot()  # raises first if a graph ran without its replay
        return self.ring.seq % SLOTS

    def send(self, index: int, dev: torch.Tensor, *, now: bool) -> None:
        if now:
            dev.copy_(self.slots[index], non_blocking=self.pinned)
        self.ring.publish(sent=now)

    def record(self, dev: torch.Tensor, *, first: bool) -> None:
        """The pull: launched inside a CUDA capture (recorded, not run), run at an emulated
        graph's replays; not at the first record of an emulated graph, which is its capture
        (the replay that staged for it is yet to come)."""
        capturing = self.ring.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or not first:
            self.ring.pull(dev)

    def launched(self) -> None:
        self.ring.launched()
