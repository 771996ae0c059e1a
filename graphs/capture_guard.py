"""Graph safety on the CPU: what an emulated capture refuses, and why.

A CUDA graph capture fails, or silently bakes in a value, when the captured code reads a
device tensor on the host, makes a shape that depends on data (the host must read the
size), or allocates memory the graph's pool does not own. On the CPU all of that just
works, so a metadata-op provider or a model layer that would break a real capture would
pass every CPU test. While an :class:`~graphs.emulated.EmulatedGraph` captures, it runs the
callable under :class:`CaptureGuard`, a public ``torch.overrides.TorchFunctionMode`` that
sees each torch call the captured Python makes and refuses, with a
:class:`~planner.errors.GraphSafetyError`, those a GPU capture would not survive:

- **host reads**: ``.item()``, ``.tolist()``, ``.numpy()``, ``np.asarray(t)``, ``.cpu()``,
  ``.to("cpu")`` (every tensor is on the CPU here, so any of them is the device-to-host
  read it would be on a GPU; ``.to(device)`` with a ``torch.device`` is let through, as
  forwards name their own device so), the implicit ``.item()`` of ``bool(t)``, ``int(t)``,
  ``float(t)``, ``t.__index__`` and ``x in t``, formatting a tensor, and torch functions
  that answer a Python bool (``torch.equal``, ``allclose``, ``is_nonzero``);
- **data-dependent shapes**: ``nonzero``, ``argwhere``, one-argument ``torch.where``,
  ``unique``, ``unique_consecutive``, ``masked_select``, ``bincount``, ``repeat_interleave``
  with tensor ``repeats`` and no ``output_size``, and boolean-mask indexing ``x[mask]``;
- **allocation outside the graph's pool**: pinned host memory (``pin_memory=True``,
  ``.pin_memory()``) and tensors built from host data (``torch.tensor`` / ``as_tensor`` /
  ``asarray`` / ``Tensor.new_tensor`` of anything but a tensor, ``torch.from_numpy``): on a
  GPU each is host memory copied to the device from pageable memory (refused by a
  capturing stream), and its value would be baked into the graph.

The error names the op, the provider and the plan field when the refused call came from
a metadata op's provider (while a guard is on, the planner says which provider runs:
``planner.ops.running_provider``), else the function and line that made it. Providers
that declare ``graph_safe=False`` are never run under capture (the planner runs them
before the graph, at ``capture`` and ``replay``), so they may do all of the above.

Only the capture is guarded: an emulated replay, eager plans and everything outside a
capture run with no mode and no cost. What it cannot see: calls made inside another torch
function (a mode sees the outermost call only), device-to-host ``copy_`` into a host
buffer and host allocations with ``device="cpu"`` (every tensor is on the CPU here), and
host syncs that are no torch call (``torch.cuda.synchronize``). The GPU tests check the
real capture.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from planner.errors import GraphSafetyError
from planner.ops import guarding_capture, running_provider

Check = Callable[[Sequence[Any], Mapping[str, Any]], str | None]
"""``check(args, kwargs)``: why this call would break a capture, or None when it would not."""

HOST_READ = "reads a tensor on the host (a device-to-host sync on a GPU)"
IMPLICIT_ITEM = "is an implicit .item(): reads a device value on the host (a sync)"
DATA_SHAPE = "makes an output whose shape depends on the data (the host must read its size)"
HOST_DATA = (
    "builds a tensor from host data: a pageable host-to-device copy on a GPU, outside the "
    "graph's pool, its value baked into the graph"
)
PINNED = "allocates pinned host memory, outside the graph's pool"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
_real_from_numpy = torch.from_numpy
_state = threading.local()
"""Per thread, how many guards are active (torch function modes are per thread too)."""
_patch_lock = threading.Lock()
_patched = 0


def _always(why: str) -> Check:
    return lambda args, kwargs: why


def _to_host(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """``Tensor.to("cpu")``: the CPU named as a string. A ``torch.device`` (or a tensor) is
    let through: it is how forwards name their own compute device (``x.to(y.device)``, a
    no-op on a GPU), which is the CPU here, so refusing it would refuse graph-safe code."""
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return HOST_READ
    return None


def _where(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """One-argument ``torch.where(cond)`` is ``nonzero(cond, as_tuple=True)``."""
    return DATA_SHAPE if len(args) + len(kwargs) == 1 else None


def _repeat_interleave(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Tensor ``repeats`` (or the one-argument form) sum to the output size: unless
    ``output_size`` gives it, the host reads it."""
    if kwargs.get("output_size") is not None or len(args) > 3:
        return None
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    if isinstance(repeats, torch.Tensor):
        return f"{DATA_SHAPE}; pass output_size"
    return None


def _mask_index(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """``x[mask]`` with a boolean (or uint8) tensor anywhere in the index."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8):
            return f"indexes with a boolean mask: {DATA_SHAPE}"
    return None


def _host_data(args: Sequence[Any], kwargs: Mapping[str, Any], at: int = 0) -> str | None:
    data = args[at] if len(args) > at else kwargs.get("data", kwargs.get("obj"))
    return None if isinstance(data, torch.Tensor) else HOST_DATA


def _checks() -> dict[Any, tuple[str, Check]]:
    """Each refused torch callable: how to name it, and when it is refused."""
    T = torch.Tensor
    table: dict[Any, tuple[str, Check]] = {}
    for name in ("item", "tolist", "numpy", "__array__", "cpu"):
        table[getattr(T, name)] = (f".{name}()", _always(HOST_READ))
    table[T.to] = (".to(cpu)", _to_host)
    for name, shown in (
        ("__bool__", "bool(tensor)"),
        ("__int__", "int(tensor)"),
        ("__float__", "float(tensor)"),
        ("__complex__", "complex(tensor)"),
        ("__index__", "tensor.__index__ (a tensor used as a Python int)"),
        ("__contains__", "x in tensor"),
    ):
        table[getattr(T, name)] = (shown, _always(IMPLICIT_ITEM))
    for fn, shown in ((T.__format__, "formatting a tensor"), (T.__repr__, "repr(tensor)")):
        table[fn] = (shown, _always(HOST_READ))
    for name in ("equal", "allclose", "is_nonzero"):
        why = f"answers a Python bool: {HOST_READ}"
        table[getattr(torch, name)] = (f"torch.{name}", _always(why))
        table[getattr(T, name)] = (f".{name}()", _always(why))
    for name in ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"):
        table[getattr(torch, name)] = (f"torch.{name}", _always(DATA_SHAPE))
        table[getattr(T, name)] = (f".{name}()", _always(DATA_SHAPE))
    table[torch.bincount] = ("torch.bincount", _always(DATA_SHAPE))
    table[T.bincount] = (".bincount()", _always(DATA_SHAPE))
    table[torch.where] = ("torch.where(cond)", _where)
    table[torch.repeat_interleave] = ("torch.repeat_interleave", _repeat_interleave)
    table[T.repeat_interleave] = (".repeat_interleave()", _repeat_interleave)
    table[T.__getitem__] = ("x[mask]", _mask_index)
    table[T.pin_memory] = (".pin_memory()", _always(PINNED))
    for name in ("tensor", "as_tensor", "asarray"):
        table[getattr(torch, name)] = (f"torch.{name}", _host_data)
    table[T.new_tensor] = (".new_tensor()", lambda args, kwargs: _host_data(args, kwargs, 1))
    return table


_CHECKS = _checks()


class CaptureGuard(TorchFunctionMode):
    """Refuses the torch calls a CUDA graph capture would not survive; see the module
    docstring. Enter it around a capture (``EmulatedGraph.capture`` does)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        entry = _CHECKS.get(func)
        if entry is not None:
            why = entry[1](args, kwargs)
            if why is not None:
                raise refusal(entry[0], why)
        if kwargs.get("pin_memory"):
            raise refusal(f"{getattr(func, '__name__', func)}(pin_memory=True)", PINNED)
        return func(*args, **kwargs)

    def __enter__(self) -> CaptureGuard:
        _state.depth = getattr(_state, "depth", 0) + 1
        _patch_from_numpy(+1)
        self._watch = guarding_capture()
        self._watch.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._leave()

    def _leave(self) -> None:
        self._watch.__exit__(None, None, None)
        _patch_from_numpy(-1)
        _state.depth -= 1


def guarding() -> bool:
    """True on this thread while a :class:`CaptureGuard` is active."""
    return getattr(_state, "depth", 0) > 0


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` while a guard is on (in any thread; it refuses in the guarded
    one only): no torch function mode sees it (it dispatches nothing), so the guard puts
    this in its place for the capture and puts the real one back after."""
    if guarding():
        raise refusal("torch.from_numpy", HOST_DATA)
    return _real_from_numpy(array)


def _patch_from_numpy(delta: int) -> None:
    global _patched
    with _patch_lock:
        _patched += delta
        if delta > 0 and _patched == 1:
            torch.from_numpy = _from_numpy
        elif delta < 0 and _patched == 0 and torch.from_numpy is _from_numpy:
            torch.from_numpy = _real_from_numpy


def refusal(what: str, why: str) -> GraphSafetyError:
    """The error for a refused call, naming the provider that made it (when one runs) and
    the line of Python that did; ``what``, ``op``, ``provider`` and ``where`` are kept on it."""
    where = _caller()
    running = running_provider()
    key, op, provider = running if running is not None else (None, None, None)
    by = f"op {op!r} provider {provider!r} ({where})" if op is not None else where
    error = GraphSafetyError(f"refused under graph capture: {what} {why}, in {by}", field=key)
    error.what, error.op, error.provider, error.where = what, op, provider, where
    return error


def _caller() -> str:
    """``path:line in function`` of the innermost frame outside torch and this module."""
    frame: FrameType | None = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH_DIR):
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)
            try:
                shown = os.path.relpath(path)
            except ValueError:  # another drive (Windows)
                shown = path
            if shown.startswith(".."):
                shown = path
            return f"{shown}:{frame.f_lineno} in {name}"
        frame = frame.f_back
    return "<unknown>"
