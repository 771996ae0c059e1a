"""Recording a CUDA event on the current stream, at a fraction of ``Event.record()``'s cost.

Why: every replay records one event after its staging copy (so the pinned buffer is not
refilled before the copy ran), and every FlashInfer host op one more. ``record()`` with no
stream asks ``torch.cuda.current_stream()``, which resolves the device index in Python
and builds a new ``Stream`` object each call: about a tenth of a replay's host time on the
H200's host in r7-4's profile. Here the current stream is read as its raw ids and the
``Stream`` object made once per stream; the event is recorded on it through the public
``record(stream)``.
"""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_KEPT = 64
_GET = getattr(torch._C, "_cuda_getCurrentStream", None)


def current_stream_ids(device_index: int) -> tuple[int, int, int] | None:
    """The current stream of device ``device_index`` as its raw ids (None on a torch
    without the raw query): cheap to compare, a key for :func:`record_on_stream`."""
    return None if _GET is None else _GET(device_index)


def record_on_stream(event: torch.cuda.Event, ids: tuple[int, int, int] | None) -> None:
    """``event.record(stream)`` on the stream :func:`current_stream_ids` named (None: the
    current stream, through the public path)."""
    if ids is None:
        event.record()
        return
    stream = _STREAMS.get(ids)
    if stream is None:
        if len(_STREAMS) >= _KEPT:
            _STREAMS.pop(next(iter(_STREAMS)))
        stream = _STREAMS[ids] = torch.cuda.Stream(
            stream_id=ids[0], device_index=ids[1], device_type=ids[2]
        )
    event.record(stream)


def record_on_current_stream(event: torch.cuda.Event, device_index: int) -> None:
    """``event.record()`` on device ``device_index``'s current stream."""
    if _GET is None:  # a torch without the raw query: the public path
        with torch.cuda.device(device_index):
            event.record()
        return
    record_on_stream(event, _GET(device_index))
