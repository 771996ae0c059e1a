"""The two graph kinds the runner drives, behind one small interface.

The runner needs three things of a graph: capture a callable into a shared
pool, replay, and hand out its pool. ``torch.cuda.CUDAGraph`` does it with a
capture *context*; the emulation needs the callable itself (it cannot see
kernel launches), so the interface takes a callable and the CUDA adapter
wraps it in ``torch.cuda.graph``: three lines, so nothing else differs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
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
        self._graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        self._stream = stream

    def capture(self, fn: Callable[[], Any], *, pool: Any = None) -> Any:
        """Record ``fn``'s kernels into the graph (nothing executes); return its outputs."""
        previous = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(self._graph, pool=pool, stream=self._stream):
                return fn()
        except BaseException:
            # Freeing the failed graph lets newer torch's CUDAGraph::reset() tidy the allocator.
            self._graph = None
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


def recover_after_failed_capture(pool: Any) -> None:
    """Leave torch able to capture again after a capture failed; call outside the ``except``.

    When CUDA invalidates a capture (a host sync inside it), older torch's
    ``CUDAGraph::capture_end`` raises before ``endAllocateToPool``: the caching
    allocator believes a capture is still underway, and the next
    ``torch.cuda.empty_cache()`` (which every ``torch.cuda.graph`` entry calls) dies on
    ``captures_underway.empty() INTERNAL ASSERT``, so every later size would be
    dropped. Newer torch tidies up itself, in capture_end or when the failed graph is
    freed. So: free it, probe, and only if the allocator is still capturing, end the
    capture into our pool by hand (ending it when torch already did would raise).
    """
    gc.collect()  # the failed graph may sit in a traceback cycle
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        if "captures_underway" not in str(exc) or pool is None:
            raise
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def on_capture_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on the CUDA capture ``stream``, ordered after the work before it and
    before the work after it; a no-op without one (emulated graphs).

    Why: a graph's warm-up must run on the stream it is captured on. cuBLAS(Lt) keeps its
    handles and workspaces per (device, stream) and makes them on a stream's first GEMM;
    made inside a capture, that setup is capture-unsafe (upstream fixed the same in
    ``make_graphed_callables``, pytorch#187745). Warmed up on the current stream and captured
    on a fresh side stream, a runner's first GEMM on that stream came inside its capture: on
    an H100 (2a925c0 and 62baad5) a second engine in one process dropped a mixed graph, its
    GEMM failing with CUBLAS_STATUS_EXECUTION_FAILED or a later Triton launch on that error
    (``tests/gpu/test_overlap_gpu.py``, two engines)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for the body, as it was after.

    Why: a collection inside a capture can free a dead runner's CUDA graphs (runners and the
    engines that own them sit in reference cycles, so the collector is what frees them), and
    destroying a graph while a stream captures in the global mode is an illegal call: CUDA
    invalidates the capture. On an H200 (s63-2, 2b3e7e8) a second engine's ``mixed/128`` was
    lost that way in the GPU suite: "operation not permitted when stream is capturing" from
    ``CUDAGraph::reset`` for each of the first engine's graphs, then "operation failed due to
    a previous error during capture" at the capture's next Triton launch."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
