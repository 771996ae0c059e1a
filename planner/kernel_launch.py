"""A device step's kernel launch, worked out once, for the eager lane to queue from C.

Why: a metadata kernel's launch through Triton's launcher costs about 9 us of host time on
the H200's host, and the Python that checks and packs its arguments as much again, per
eager plan; a plan whose layout repeats (the same batch shape planned again) would pay
that for arguments it already knows. A backend whose step can say exactly what its launch
is hands the planner a :class:`KernelLaunch`: the compiled function, grid, block, shared
bytes and every parameter with its size. ``planner.lane_submit`` turns the tensors among
them into offsets from the plan's buffer or the token table, and ``lane_submit.c`` queues
it with ``cuLaunchKernel``.

It is only taken where it means exactly what the backend's own launch does: the driver's
own account of the function's parameters (``cuFuncGetParamInfo``) must be the sizes the
backend gave, one for one, and the backend's ``live`` check (no launch hooks, no
interpreter) must hold at every plan. Anything else keeps the backend's launch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MAX_PARAMS = 256
"""Parameters asked of the driver before giving up on a function."""


@dataclass(frozen=True)
class KernelLaunch:
    """One launch as ``cuLaunchKernel`` takes it (a block of ``block`` threads in x)."""

    function: int
    """The ``CUfunction`` handle."""
    grid: tuple[int, int, int]
    block: int
    shared: int
    """Dynamic shared memory, in bytes."""
    params: tuple[tuple[torch.Tensor | int, int], ...]
    """Each parameter in order: a tensor (its address) or an int, and its size in bytes."""
    live: Callable[[], bool]
    """Whether the launch may still go this way (a profiler's launch hook turns it off)."""


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or None."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def launch_address() -> int | None:
    """The address of the driver's ``cuLaunchKernel``, or None."""
    driver = _driver()
    fn = getattr(driver, "cuLaunchKernel", None) if driver is not None else None
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=256)
def param_sizes(function: int) -> tuple[int, ...] | None:
    """The sizes in bytes of ``function``'s parameters, as the driver reports them; None
    where it cannot (a driver before CUDA 12.4 has no ``cuFuncGetParamInfo``)."""
    driver = _driver()
    info = getattr(driver, "cuFuncGetParamInfo", None) if driver is not None else None
    if info is None or not function:
        return None
    info.restype = ctypes.c_int
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    sizes = []
    for index in range(_MAX_PARAMS):
        if info(function, index, ctypes.byref(offset), ctypes.byref(size)) != 0:
            return tuple(sizes)  # past the last parameter
        sizes.append(size.value)
    return None


def matches_driver(launch: KernelLaunch) -> bool:
    """Whether the driver's parameters of ``launch.function`` are ``launch.params``' sizes."""
    return param_sizes(launch.function) == tuple(size for _, size in launch.params)
