"""The guard every host op needs around pinned host arrays that async copies read.

A host op fills pinned arrays and enqueues ``non_blocking`` copies out of them (its own
and a library's, such as FlashInfer's ``plan``). Refilling them for the next batch
before those copies ran would send the next batch's values to the previous one; waiting
on every call would sync the host to the GPU. So: record an event after the copies,
and wait on it only before the next refill (normally long done by then).
"""

from __future__ import annotations

import torch


class PinnedCopies:
    """``before_refill()`` before writing the arrays, ``after_enqueue()`` after the copies
    that read them; a no-op pair off CUDA (host arrays are not pinned there). ``device``:
    the one the copies go to (resolved once; asking the current device costs a call a
    replay)."""

    def __init__(self, pinned: bool, device: torch.device | None = None) -> None:
        self._done = torch.cuda.Event() if pinned else None
        self._pending = False
        self._index: int | None = None
        if pinned:
            index = None if device is None else device.index
            self._index = torch.cuda.current_device() if index is None else index

    def before_refill(self) -> None:
        if self._pending:
            self._done.synchronize()
            self._pending = False

    def after_enqueue(self) -> None:
        if self._done is not None:
            self._done.record(torch.cuda.current_stream(self._index))
            self._pending = True
