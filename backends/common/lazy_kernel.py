"""How the planner's Triton kernels are decorated and launched: lazily, and prebound.

``LazyKernel`` decorates a kernel on its first launch (see its docstring). Once compiled,
an unspecialised kernel is launched without Triton's binder where that is safe.

Why: outside a CUDA graph, every launch of a JIT kernel pays for Triton's Python launcher:
binding the arguments, computing each one's specialisation, hashing the cache key,
checking the kernel's globals. On the GPU hosts we measure that is 40-70 us a launch
(docs/benchmarks.md, r7-4), several times the kernel, and an eager plan launches two or
three of them. The planner's metadata kernels are compiled unspecialised on purpose
(``LazyKernel``): one variant whatever the sizes and pointers, so which compiled kernel a
launch needs follows from what this module can tell cheaply: each argument's dtype or
integer width, the constexprs' values, the device. After the first launch of each such
key (through Triton, which compiles and returns the kernel), later ones call the compiled
kernel directly.

It is never trusted blindly. It is used only where every argument's specialisation is
known to be off (an int or a tensor in a place Triton would specialise it goes through
Triton's launcher, every time); an argument of a kind it does not key on, or keyword
arguments that do not fill the signature's tail, go through Triton too; a compiled kernel that cannot be called that way
turns it off for that kernel, said once. ``FORWARD_PLANNER_PREBOUND=0`` turns it off.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from planner.notices import warn_once

try:
    import triton
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63
_PLAIN = (type(None), bool, str)
_VARIANTS_KEPT = 64
"""Compiled variants one kernel keeps prebound; launches of further ones go through Triton."""


def enabled() -> bool:
    """Whether launches may skip Triton's binder (``FORWARD_PLANNER_PREBOUND=0``: never)."""
    return os.environ.get("FORWARD_PLANNER_PREBOUND", "1") not in ("0", "false", "no", "off")


def _current_device() -> int:
    """Triton compiles per device: the one a launch goes to."""
    return torch.cuda.current_device()


def _int_width(value: int) -> int:
    # Triton passes an unspecialised int as i32, u64 or i64 by its range: one variant each.
    if _I32_MIN <= value <= _I32_MAX:
        return 0
    return 1 if value >= _U64_MIN else 2


class PreboundLaunches:
    """The compiled variants of one JIT kernel, by what selects them; see the module docstring."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.prebound = 0
        """Launches that skipped Triton's launcher (tests and benchmarks read it)."""
        self._compiled: dict[tuple, Any] = {}
        params = getattr(kernel, "params", None)
        try:
            self._names = tuple(p.name for p in params)
            # Per parameter: a constexpr (keyed by value), or which values Triton leaves
            # unspecialised there: an int only under do_not_specialize (else 1 and multiples
            # of 16 are variants), a tensor under either flag (its only variant is alignment).
            self._params = tuple(
                (
                    bool(p.is_constexpr),
                    bool(p.do_not_specialize),
                    bool(p.do_not_specialize or p.do_not_specialize_on_alignment),
                )
                for p in params
            )
        except (AttributeError, TypeError):  # a Triton that does not describe its params so
            self._params = ()
        self.usable = bool(self._params) and all(any(flags) for flags in self._params)

    def _key(self, full: tuple) -> tuple | None:
        key: list[Any] = [_current_device()]
        for value, (constexpr, int_free, tensor_free) in zip(full, self._params):
            kind = type(value)
            if constexpr:
                key.append(value)
            elif kind is int and int_free:
                key.append(_int_width(value))
            elif isinstance(value, torch.Tensor) and tensor_free:
                key.append(value.dtype)
            elif kind is float:  # always passed as fp32, never specialised
                key.append(float)
            elif kind in _PLAIN:
                key.append((kind, value))
            else:  # a kind it does not key on, or a value Triton would specialise
                return None
        return tuple(key)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Launch over ``grid``: prebound where the key is known, else through Triton."""
        full = args
        if kwargs:
            tail = self._names[len(args) :]
            if len(tail) != len(kwargs) or not all(name in kwargs for name in tail):
                return self.kernel[grid](*args, **kwargs)
            full = args + tuple(kwargs[name] for name in tail)
        key = self._key(full) if len(full) == len(self._names) else None
        compiled = None if key is None else self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and len(self._compiled) < _VARIANTS_KEPT:
                if callable(getattr(compiled, "__getitem__", None)):
                    self._compiled[key] = compiled
                else:
                    self._turn_off(f"its launch returned {type(compiled).__name__}")
            return compiled
        try:
            compiled[(*grid, 1, 1)[:3]](*full)
        except Exception as exc:  # raised before launching: nothing ran, Triton launches it
            self._turn_off(f"{type(exc).__name__}: {exc}")
            return self.kernel[grid](*args, **kwargs)
        self.prebound += 1
        return compiled

    def _turn_off(self, why: str) -> None:
        self.usable = False
        self._compiled.clear()
        name = getattr(getattr(self.kernel, "fn", None), "__name__", "a kernel")
        warn_once(f"{name}: compiled kernel not callable directly ({why}); Triton launches it")


def launcher(launches: PreboundLaunches, grid: tuple[int, ...]) -> Callable[..., Any]:
    """``kernel[grid]`` through ``launches``."""
    return lambda *args, **kwargs: launches.launch(grid, args, kwargs)


def _interpreting() -> bool:
    # Ask triton itself when it can tell, so this agrees with what triton.jit does.
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    """

    def __init__(self, fn: Callable[..., None], *, aligned: bool = False) -> None:
        self._fn = fn
        self._aligned = aligned
        self._variants: dict[bool, Any] = {}
        self.launches: PreboundLaunches | None = None
        """The compiled kernel's prebound launches (above): unaligned
        kernels are unspecialised, so their variants follow from dtypes and constexprs."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        mode = _interpreting()
        kernel = self._variants.get(mode)
        if kernel is None:
            # Sizes, strides and where a view starts change every batch: specialising on them
            # (value 1, divisible by 16, a 16-byte aligned pointer) compiles a new variant
            # mid-serving, 0.15-0.2 s of stall in an eager extend plan on the H200. These
            # kernels move a few KB; wide vector loads would not pay for that.
            params = inspect.signature(self._fn).parameters
            sizes = [p for p in params if not p.endswith("_ptr") and not p.isupper()]
            pointers = [] if self._aligned else [p for p in params if p.endswith("_ptr")]
            kernel = self._variants[mode] = triton.jit(self._fn, **unspecialised(sizes, pointers))
            if not mode and not self._aligned:
                self.launches = PreboundLaunches(kernel)
        launches = self.launches
        if mode or launches is None or not launches.usable or not enabled():
            return kernel[grid]
        return launcher(launches, grid)


def unspecialised(sizes: list[str], pointers: list[str]) -> dict[str, list[str]]:
    """``triton.jit`` keywords that compile one variant whatever these arguments' values;
    alignment is left specialised on a Triton too old to be told (before 3.2)."""
    keywords = {"do_not_specialize": sizes}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        keywords["do_not_specialize_on_alignment"] = pointers
    return keywords
