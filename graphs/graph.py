"""The two graph kinds the runner drives, behind one small interface.

The runner needs three things of a graph: capture a callable into a shared
pool, replay, and hand out its pool. ``torch.cuda.CUDAGraph`` does it with a
capture *context*; the emulation needs the callable itself (it cannot see
kernel launches), so the interface takes a callable and the CUDA adapter
wraps it in ``torch.cuda.graph``: three lines, so nothing else differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from graphs.emulated import EmulatedGraph, EmulatedPool, emulated_capturing

GraphKind = Literal["cuda", "emulated"]


class Graph(Protocol):
    """What the runner uses of a graph."""

    def capture(self, fn: Callable[[], Any], *, pool: Any = None) -> Any: ...

    def replay(self) -> None: ...

    def pool(self) -> Any: ...

    def reset(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph`` captured from a callable on a shared side stream."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._stream = stream

    def capture(self, fn: Callable[[], Any], *, pool: Any = None) -> Any:
        """Record ``fn``'s kernels into the graph (nothing executes); return its outputs."""
        previous = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(self._graph, pool=pool, stream=self._stream):
                return fn()
        except BaseException:
            _end_failed_capture(pool)
            raise
        finally:
            # When capture_end raises (a capture invalidated by a sync), torch.cuda.graph
            # skips restoring the stream; later work would silently run on the side stream.
            torch.cuda.set_stream(previous)

    def replay(self) -> None:
        self._graph.replay()

    def pool(self) -> Any:
        return self._graph.pool()

    def reset(self) -> None:
        self._graph.reset()


def _end_failed_capture(pool: Any) -> None:
    """Take the caching allocator out of capture mode after a capture that CUDA invalidated.

    ``CUDAGraph::capture_end`` raises on ``cudaStreamEndCapture``'s error before it
    calls ``endAllocateToPool``, so the allocator believes a capture is still underway:
    the next ``torch.cuda.empty_cache()`` (which every ``torch.cuda.graph`` entry calls)
    then dies on ``captures_underway.empty() INTERNAL ASSERT``, and every later size
    would be dropped. After a plain Python error in the body, capture_end succeeded,
    nothing is left behind, and the call below raises; that is ignored.
    """
    if pool is None:
        return
    with contextlib.suppress(RuntimeError, AttributeError, TypeError):
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


def new_pool(kind: GraphKind) -> Any:
    """A fresh memory pool that all graphs of one runner share."""
    return torch.cuda.graph_pool_handle() if kind == "cuda" else EmulatedPool()


def new_graph(kind: GraphKind, stream: torch.cuda.Stream | None = None) -> Graph:
    """An empty graph of ``kind``; ``stream`` is the CUDA capture stream (ignored when emulated)."""
    return CudaGraph(stream) if kind == "cuda" else EmulatedGraph()


def is_capturing() -> bool:
    """True inside a graph capture of either kind: forwards may use it to skip host syncs."""
    if emulated_capturing():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
