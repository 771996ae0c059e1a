"""``record_on_current_stream`` records where ``Event.record()`` would: the current stream.

The staging ring's and the host ops' pinned buffers are refilled once their event says the
copy out of them ran; an event recorded on another stream than the copy's would say so
too early (the next batch's values sent to the previous one).
"""

from __future__ import annotations

import pytest
import torch

from planner.cuda_events import record_on_current_stream

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("side", [False, True])
def test_the_event_waits_for_work_queued_on_the_current_stream(side):
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the record
        record_on_current_stream(event, torch.cuda.current_device())
    assert not event.query()  # recorded behind the sleep, not on an idle stream
    event.synchronize()
    assert event.query()
    torch.cuda.synchronize()


def test_a_stream_object_is_made_once_per_stream():
    from planner import cuda_events

    index = torch.cuda.current_device()
    event = torch.cuda.Event()
    record_on_current_stream(event, index)
    before = len(cuda_events._STREAMS)
    for _ in range(10):
        record_on_current_stream(event, index)
    assert len(cuda_events._STREAMS) == before
    torch.cuda.synchronize()


@pytest.mark.parametrize("switch_streams", [False, True])
def test_the_staging_ring_never_refills_a_buffer_its_copy_has_not_read(switch_streams):
    """The GPU held up behind a sleep while the host sends three rounds of the ring: every
    copy must deliver the value its buffer held when it was sent (one event per few copies,
    closed early when the stream changes)."""
    from planner.stager import RING, Stager
    from planner.staging import StagingLayout

    device = torch.device("cuda", torch.cuda.current_device())
    layout = StagingLayout([], 4, 4)
    stager = Stager(layout, device, static=False)
    side = torch.cuda.Stream()
    sent = []
    torch.cuda._sleep(200_000_000)  # the copies queue up behind ~0.1 s of GPU time
    for i in range(3 * RING):
        host, view, done = stager.next_host(16)
        view[:16] = i
        dev = torch.empty(16, dtype=torch.int32, device=device)
        stream = side if switch_streams and i % 3 == 0 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            stager.send(host[:16], dev, done)
        sent.append(dev)
    torch.cuda.synchronize()
    assert [int(d[0]) for d in sent] == list(range(3 * RING))
    assert all(bool((d == d[0]).all()) for d in sent)
    assert stager._events.recorded < 3 * RING  # fewer events than copies
