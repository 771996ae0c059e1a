"""A CPU stand-in for ``torch.cuda.CUDAGraph``, so capture and replay logic runs in CI.

A real graph records kernel launches once and replays them over the same
memory; Python does not run again. The emulation cannot intercept launches,
so it records the captured *callable* instead and re-executes it on replay
over the same static buffers it closed over. What makes the emulation
faithful where the runner's bugs would show:

- outputs are the same tensors on every replay: results are copied into the
  output tensors of the capture, as a graph writes into the same pool memory;
- outputs hold garbage (NaN / a sentinel) between capture and the first
  replay, as after a real capture, which launches nothing;
- replay before capture, capturing twice, or a replay whose outputs change
  shape raise, as they would fail (or corrupt memory) on a GPU.

What a GPU capture would not survive is refused during the capture, with a
``GraphSafetyError`` naming the op and provider (or the line of Python) that did it:
host syncs (``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``bool(tensor)``...),
shapes that depend on data (``nonzero``, ``unique``, ``x[mask]``...) and allocations
outside the graph's pool (pinned memory, tensors built from host data). The capture runs
under ``graphs.capture_guard.CaptureGuard``, which lists every kind and what it cannot see.

Where it is still *more* forgiving than a GPU: host code in the callable runs again on
every replay (a graph bakes in the values Python saw at capture), and the replay is not
guarded (it re-runs the code the capture already checked, at no cost). Forwards must not
depend on the first; the GPU tests check the real thing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from graphs.capture_guard import CaptureGuard

_capture_depth = 0
_pool_ids = itertools.count(1)
POISON_INT = -0x5A5A5A5A
"""What integer outputs hold between capture and first replay (float outputs hold NaN)."""


def emulated_capturing() -> bool:
    """True while an :class:`EmulatedGraph` is capturing (the analogue of a capturing stream)."""
    return _capture_depth > 0


class EmulatedPool:
    """An opaque memory-pool handle, like ``torch.cuda.graph_pool_handle()``: graphs share it by identity."""

    def __init__(self) -> None:
        self.id = next(_pool_ids)
        self.graphs = 0

    def __repr__(self) -> str:
        return f"EmulatedPool({self.id}, graphs={self.graphs})"


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    """The tensors of a forward's result (a tensor, or a dict / list / tuple of them), in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        return [t for key in outputs for t in flatten_outputs(outputs[key])]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in flatten_outputs(item)]
    raise TypeError(
        f"graph outputs must be tensors (or dicts/lists of them), got {type(outputs).__name__}"
    )


def _poison(tensor: torch.Tensor) -> None:
    # Only tensors the callable allocated (not views into state it was given): a real capture
    # leaves its fresh outputs uninitialised, never the caller's buffers.
    if tensor._base is not None or tensor.numel() == 0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        info = torch.iinfo(tensor.dtype)
        tensor.fill_(max(info.min, min(info.max, POISON_INT)))


class EmulatedGraph:
    """Records a callable at capture and re-runs it on replay into the captured outputs."""

    def __init__(self, *, poison: bool = True) -> None:
        self._fn: Callable[[], Any] | None = None
        self._outputs: list[torch.Tensor] = []
        self._pool: EmulatedPool | None = None
        self._poison = poison
        self.replays = 0

    def capture(self, fn: Callable[[], Any], *, pool: EmulatedPool | None = None) -> Any:
        """Run ``fn`` once (the capture), keep it and its outputs; return the outputs.

        The outputs hold no valid data until :meth:`replay`, as with a real graph. ``fn``
        runs under :class:`~graphs.capture_guard.CaptureGuard`: a host sync, a data-dependent
        shape or an allocation outside the pool raises ``GraphSafetyError``.
        """
        global _capture_depth
        if self._fn is not None:
            raise RuntimeError("graph already captured; reset() it first")
        _capture_depth += 1
        try:
            with CaptureGuard():
                outputs = fn()
        finally:
            _capture_depth -= 1
        flat = flatten_outputs(outputs)
        self._fn = fn
        self._outputs = flat
        self._pool = pool if pool is not None else EmulatedPool()
        self._pool.graphs += 1
        if self._poison:
            for tensor in flat:
                _poison(tensor)
        return outputs

    def replay(self) -> None:
        """Re-run the captured callable and copy its results into the capture's outputs."""
        if self._fn is None:
            raise RuntimeError("replay of a graph that was never captured")
        fresh = flatten_outputs(self._fn())
        if len(fresh) != len(self._outputs):
            raise RuntimeError(
                f"replay produced {len(fresh)} outputs, capture {len(self._outputs)}"
            )
        for dst, src in zip(self._outputs, fresh, strict=True):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise RuntimeError(
                    f"replay output {tuple(src.shape)} {src.dtype} differs from the captured "
                    f"{tuple(dst.shape)} {dst.dtype}: a graph's shapes are fixed"
                )
            if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride():
                continue  # the callable wrote into the captured tensor itself
            dst.copy_(src)
        self.replays += 1

    def pool(self) -> EmulatedPool:
        """The pool this graph captured into (share it with the next capture)."""
        if self._pool is None:
            raise RuntimeError("graph has no pool before capture")
        return self._pool

    def reset(self) -> None:
        """Forget the capture (frees the outputs it holds)."""
        if self._pool is not None:
            self._pool.graphs -= 1
        self._fn, self._outputs, self._pool = None, [], None
