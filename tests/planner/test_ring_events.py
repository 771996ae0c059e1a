"""The staging ring's events, on a simulated GPU: a buffer is never refilled before the copy
that last read it has run, whatever the streams and however far behind the GPU is; and one
stream needs about one event per ``GROUP`` copies, each waited on at most once.

The simulation: each stream is a queue the GPU runs in order, at its own pace; a copy and
an event record are items in it; ``synchronize`` runs the stream up to the event. On CUDA
the same class runs with real events (``tests/gpu/test_cuda_events_gpu.py``).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import ring_events
from planner.ring_events import GROUP, RingEvents


class _GPU:
    def __init__(self) -> None:
        self.queues: dict[tuple, list] = {}
        self.done: dict[tuple, int] = {}
        self.current: tuple = (1, 0, 1)
        self.copies_done: set[int] = set()

    def enqueue(self, item) -> int:
        queue = self.queues.setdefault(self.current, [])
        queue.append(item)
        return len(queue)

    def run(self, stream: tuple, upto: int) -> None:
        queue, done = self.queues.get(stream, []), self.done.get(stream, 0)
        upto = min(upto, len(queue))  # the GPU cannot run what is not queued yet
        for kind, value in queue[done:upto]:
            if kind == "copy":
                self.copies_done.add(value)
        self.done[stream] = max(done, upto)

    def progress(self, rng: random.Random) -> None:
        for stream in self.queues:
            self.run(stream, self.done.get(stream, 0) + rng.randint(0, 2))


class _Event:
    gpu: _GPU

    def __init__(self) -> None:
        self.at: tuple | None = None

    def record(self, stream=None) -> None:
        ids = self.gpu.current if stream is None else stream
        saved, self.gpu.current = self.gpu.current, ids
        self.at = (ids, self.gpu.enqueue(("event", None)))
        self.gpu.current = saved

    def synchronize(self) -> None:
        if self.at is not None:
            self.gpu.run(*self.at)


@pytest.fixture
def new_gpu(monkeypatch):
    """A function making a fresh simulated GPU, which the ring's events then run on."""
    monkeypatch.setattr(ring_events.torch.cuda, "Event", _Event)
    monkeypatch.setattr(ring_events, "current_stream_ids", lambda index: _Event.gpu.current)
    monkeypatch.setattr(ring_events, "record_on_stream", lambda event, ids: event.record(ids))

    def make() -> _GPU:
        _Event.gpu = _GPU()
        return _Event.gpu

    return make


def _serve(gpu: _GPU, events: RingEvents, rng: random.Random, copies: int, streams: int, unsent):
    """``copies`` sends through the ring; before each fill, the copy that last read the
    buffer must have run."""
    for n in range(copies):
        events.before_fill(n)
        if n >= events.size:
            assert n - events.size in gpu.copies_done, f"buffer of copy {n} refilled too early"
        if rng.random() < unsent:  # a fill the screen refused: nothing sent, filled again
            events.before_fill(n)
        if streams > 1 and rng.random() < 0.3:
            gpu.current = (1 + rng.randrange(streams), 0, 1)
        gpu.enqueue(("copy", n))
        events.after_copy(n)
        gpu.progress(rng)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10**6),
    size=st.integers(GROUP, 3 * GROUP),
    streams=st.integers(1, 3),
    unsent=st.sampled_from([0.0, 0.2]),
)
def test_no_buffer_is_refilled_before_its_copy_ran(new_gpu, seed, size, streams, unsent):
    gpu = new_gpu()  # per example: the fixture itself is made once per test
    events = RingEvents(size, 0)
    _serve(gpu, events, random.Random(seed), 120, streams, unsent)


def test_one_stream_records_an_event_per_group_and_waits_on_each_at_most_once(new_gpu):
    gpu = new_gpu()
    events = RingEvents(GROUP + 4, 0)
    _serve(gpu, events, random.Random(0), 400, 1, 0.2)
    assert events.recorded == 400 // GROUP
    assert events.waits <= events.recorded


def test_a_ring_smaller_than_a_group_is_refused(new_gpu):
    with pytest.raises(ValueError, match="smaller than a group"):
        RingEvents(GROUP - 1, 0)
