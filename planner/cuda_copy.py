"""The staging copy as one ``cudaMemcpyAsync``, at a fraction of ``Tensor.copy_``'s host cost.

Why: every replay and every eager plan sends its staged inputs to the device in one
host-to-device copy from pinned memory. On the H200's host ``copy_`` costs 19 us of host
time a call there (dispatch, its checks, a capture query), of which the
``cudaMemcpyAsync`` it ends in is 8 us (r9-1's profile); right after a graph launch, in
the runner's step, both are slower still. The planner's copies are the simplest kind:
contiguous int32 (or int64) buffers of the same size, pinned source, the current device's
current stream, so the runtime call alone does what ``copy_`` does.

What is skipped is torch's bookkeeping for the pinned block (the caching host allocator
records the copy so that a freed block is not handed out before the copy read it). The
planner's pinned buffers live as long as their stager; if one were freed with a copy in
flight, that copy could only read stale bytes into its own destination, memory of the
same stream's work that nothing reads any more. Anything unusual (no CUDA runtime found in
the process, another current device, an error from the call) takes ``copy_``, and an
error turns the direct call off for the process, said once.
``FORWARD_PLANNER_DIRECT_COPY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from planner.notices import warn_once

_H2D = 1  # cudaMemcpyHostToDevice
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _loaded_cudart() -> str | None:
    """The CUDA runtime this process already loaded (torch's own), by its path."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if "libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


@functools.cache
def _memcpy():
    """``(cudaMemcpyAsync, cudaGetLastError)``, or None: switched off, or no runtime loaded
    (looked up once CUDA is initialised, by the first copy)."""
    if os.environ.get("FORWARD_PLANNER_DIRECT_COPY", "1") in ("0", "false", "no", "off"):
        return None
    if _RAW_STREAM is None or _GET_DEVICE is None:
        return None
    path = _loaded_cudart()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        fn, last = lib.cudaMemcpyAsync, lib.cudaGetLastError
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    last.restype, last.argtypes = ctypes.c_int, []
    return fn, last


class _State:
    on = True
    direct = 0
    """Copies made directly (tests and benchmarks read it)."""


state = _State()


def to_device(dev: torch.Tensor, host: torch.Tensor, device_index: int) -> None:
    """``dev.copy_(host, non_blocking=True)`` for a contiguous pinned ``host`` and a
    contiguous ``dev`` of the same dtype and size on device ``device_index``."""
    runtime = _memcpy() if state.on else None
    if (
        runtime is None
        or dev.dtype is not host.dtype
        or dev.numel() != host.numel()
        or _GET_DEVICE() != device_index
    ):
        dev.copy_(host, non_blocking=True)
        return
    fn, last = runtime
    nbytes = host.numel() * host.element_size()
    err = fn(dev.data_ptr(), host.data_ptr(), nbytes, _H2D, _RAW_STREAM(device_index))
    if err != 0:
        last()  # clear the runtime's error so nothing later trips on it
        state.on = False
        warn_once(f"cudaMemcpyAsync returned {err}; the planner copies with copy_ from now on")
        dev.copy_(host, non_blocking=True)
        return
    state.direct += 1
