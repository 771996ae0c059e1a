"""The copy transport's ring under a delayed device: a slot is handed out again only once the
copy that read it has run, however far the host runs ahead (a loop one step ahead takes
step N+2's slot while step N's copy may still be queued)."""

from __future__ import annotations

import threading

import torch

from planner.staging import CopyTransport

DELAY_S = 0.3


class DelayedEvent:
    """A device that finishes each recorded copy ``DELAY_S`` after it was queued."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()
        self.waits = 0

    def record(self) -> None:
        self.done.clear()
        threading.Timer(DELAY_S, self.done.set).start()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waits += 1
        self.done.wait()


def test_a_slot_is_not_handed_out_while_its_copy_is_queued():
    transport = CopyTransport(8, torch.device("cpu"), events=DelayedEvent)
    dev = torch.zeros(8, dtype=torch.int32)
    first = transport.take()
    transport.slots[first].fill_(1)
    transport.send(first, dev)
    second = transport.take()  # the other slot: no copy reads it
    assert second != first and transport._events[second].query()
    transport.send(second, dev)
    event = transport._events[first]
    queued, before = not event.query(), event.waits
    again = transport.take()  # the first slot again, its copy still queued
    assert queued and again == first
    assert event.waits == before + 1 and event.query()  # handed out once its copy ran
