"""How our Triton kernels are decorated and launched: lazily, unspecialised, and, where a
plan pays a launch on the host per batch, through the compiled kernel's own launcher.

Kernels are plain functions handed to ``triton.jit`` on first launch rather than at
import (``LazyKernel``): ``triton.jit`` decides between interpreter and compiler when it
decorates, so eager decoration would freeze whatever ``TRITON_INTERPRET`` held when some
other module happened to import this one first.

``LazyKernel.launch`` exists for the eager plans' kernels: on a GPU host most of a small
metadata kernel's launch through ``triton.jit``'s run is the run's Python (knobs read from the
environment, the binder, the cache key, the grid), not the driver call (docs/benchmarks.md).
``launch`` keeps the compiled kernel of each specialisation the run made and calls its
launcher the way ``CompiledKernel.__getitem__``'s runner does. That reaches into Triton's
compiled kernel (``run``, ``function``, ``packed_metadata``) and torch's raw current stream:
this module is the one place that does, and ``tests/gpu/test_triton_launch_gpu.py`` fails
when the installed Triton no longer launches this way.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MAX = 2**63 - 1
_FAST_KEPT = 64
"""Specialisations kept per kernel for the direct launch (block sizes x index dtypes)."""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``): block sizes are host arithmetic, so a
    tile configuration is worked out (and tested) where Triton is not installed."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for the same host arithmetic (grids, tile counts)."""
    return -(-a // b)


def _interpreting() -> bool:
    # Ask triton itself when it can tell, so this agrees with what triton.jit does.
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _direct_launch_ok() -> bool:
    """Compiled mode on a Triton whose compiled kernels take the launch this module makes
    (3.4 and later: ``triton.knobs``), with no launch hooks set (a profiler's): else every
    launch goes through Triton's run."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or knobs.runtime.interpret:
        return False
    runtime = knobs.runtime
    return not (_hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook))


def _hook_set(hook: Any) -> bool:
    """A hook, or a non-empty chain of them (Triton 3.5 and later keep ``HookChain``s)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _arg_kind(value: Any, aligned: bool) -> Any:
    """What Triton's binder specialises an unspecialised argument on: a tensor's dtype (and
    16-byte alignment where kept), an int's width; None for anything else."""
    if type(value) is int:
        if _I32_MIN <= value <= _I32_MAX:
            return 32
        return 64 if -_I64_MAX - 1 <= value <= _I64_MAX else 65
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0) if aligned else value.dtype
    return None


def _kinds(args: tuple, aligned: bool) -> list:
    """``_arg_kind`` of each argument, the common cases inline (a call per argument costs
    a launch's worth over a dozen of them)."""
    return [
        a.dtype
        if type(a) is torch.Tensor and not aligned
        else (32 if type(a) is int and _I32_MIN <= a <= _I32_MAX else _arg_kind(a, aligned))
        for a in args
    ]


class LazyKernel:
    """Decorates on first launch, once per interpreter mode, so a module imported
    before ``TRITON_INTERPRET`` was set still launches under the interpreter.

    ``aligned`` keeps Triton's 16-byte pointer specialisation: for the forward's kernels
    (sparse MLA, top-k), whose wide vector loads are what they are for. Without it the
    sparse MLA gathers its 1152-byte KV rows in narrow loads: on the H200 it took 750 us
    a layer at 64 rows (45.8 ms of a 61-layer step), against 183 us in the kernel
    benchmark run before alignment was turned off (docs/benchmarks.md). Their pointers are
    allocation starts or views checked to 16-byte strides, so this is one variant a run,
    not one per batch. Sizes stay unspecialised either way.

    ``only`` names the ``(sizes, pointers)`` to leave unspecialised instead, every other
    argument specialised: for the model's GEMMs, whose weight-side sizes and strides are
    fixed for a run (their divisibility by 16 buys wide loads) while a few arguments (the
    row count, the routing's group ends) change every batch and must neither compile a
    new variant nor select another one.
    """

    def __init__(
        self,
        fn: Callable[..., None],
        *,
        aligned: bool = False,
        only: tuple[list[str], list[str]] | None = None,
    ) -> None:
        self._fn = fn
        self._aligned = aligned
        self._only = only
        self._variants: dict[bool, Any] = {}
        self._params = tuple(inspect.signature(fn).parameters)
        self._compiled: dict[tuple, tuple[Any, Any, Any]] = {}
        """Per specialisation: the compiled kernel's launcher, function and metadata."""

    def _kernel(self, mode: bool) -> Any:
        kernel = self._variants.get(mode)
        if kernel is None:
            # Sizes, strides and where a view starts change every batch: specialising on them
            # (value 1, divisible by 16, a 16-byte aligned pointer) compiles a new variant
            # mid-serving, 0.15-0.2 s of stall in an eager extend plan on the H200. These
            # kernels move a few KB; wide vector loads would not pay for that.
            sizes = [p for p in self._params if not p.endswith("_ptr") and not p.isupper()]
            pointers = [] if self._aligned else [p for p in self._params if p.endswith("_ptr")]
            if self._only is not None:
                sizes, pointers = self._only
            kernel = self._variants[mode] = triton.jit(self._fn, **unspecialised(sizes, pointers))
        return kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return self._kernel(_interpreting())[grid]

    def launch(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        """``self[grid](*args, **constexprs)``, with every argument that is not a
        ``tl.constexpr`` positional and the constexprs the kernel's last parameters, in
        order. Once a specialisation has been compiled, later launches of it call the
        compiled kernel's launcher directly on the current stream; under the interpreter,
        with launch hooks set, or for an argument it cannot key, Triton's run launches."""
        if not _direct_launch_ok() or not 1 <= len(grid) <= 3:
            self[grid](*args, **constexprs)
            return
        device = _current_device()
        kinds = _kinds(args, self._aligned)
        if None in kinds or self._params[len(args) :] != tuple(constexprs):
            self[grid](*args, **constexprs)
            return
        key = (device, *kinds, *constexprs.values())
        fast = self._compiled.get(key)
        if fast is None:
            compiled = self[grid](*args, **constexprs)  # compiles where needed, and launches
            if compiled is None or not hasattr(compiled, "packed_metadata"):
                return  # no compiled kernel handed back (a Triton that compiles elsewhere)
            if len(self._compiled) >= _FAST_KEPT:
                self._compiled.clear()
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = fast
        stream = torch._C._cuda_getCurrentRawStream(device)
        gx, gy, gz = (*grid, 1, 1)[:3]
        run(gx, gy, gz, stream, function, metadata, None, None, None, *args, *constexprs.values())


def _current_device() -> int:
    """The current CUDA device's index: the raw query (``torch.cuda.current_device``'s
    Python wrapper costs a microsecond a launch), or the wrapper where it is missing."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return get() if get is not None else torch.cuda.current_device()


def unspecialised(sizes: list[str], pointers: list[str]) -> dict[str, list[str]]:
    """``triton.jit`` keywords that compile one variant whatever these arguments' values;
    alignment is left specialised on a Triton too old to be told (before 3.2)."""
    keywords = {"do_not_specialize": sizes}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        keywords["do_not_specialize_on_alignment"] = pointers
    return keywords
