"""The staging copy as one CUDA runtime call: ``cudaMemcpyAsync`` out of a ring's pinned buffer.

Why: ``Tensor.copy_(non_blocking=True)`` goes through the dispatcher, a TensorIterator, the
copy kernel's choice and the pinned host allocator's event record before it reaches the
runtime: 6.9-7.7 us of host time on the H200's host for an empty copy (r10-3), the largest
floor of a replay. A stager's buffers need none of that: they are its own, contiguous
int32, pinned once, and the ring's events (``planner.ring_events``) already say when a
buffer may be refilled. So the copy is the runtime's own call, on the current stream,
through ``ctypes``.

It is taken only where it means exactly what ``copy_`` would: torch's own CUDA runtime
(the global symbol; else the one runtime library mapped), the destination's device current.
Anywhere else, and for good after a call that fails (with a notice), ``copy_`` runs.
``FORWARD_PLANNER_RAW_COPY=0`` turns it off (read at the first copy).

A ring buffer is replaced only after the copy that last read it ran (``Stager.next_host``
waits for that first), so the copy needs no guard from the pinned allocator either.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable

import torch

from planner.env_switch import switch_on
from planner.notices import warn_once

_HOST_TO_DEVICE = 1
"""``cudaMemcpyHostToDevice``."""
_INT32_BYTES = 4

_state: dict[str, bool | None] = {"on": True, "env": None}
"""``on``: no call failed; ``env``: what ``FORWARD_PLANNER_RAW_COPY`` said at the first
copy (None: not read yet)."""


def enabled() -> bool:
    """Whether copies take the runtime's call. The environment is read once, at the first
    copy: a lookup in ``os.environ`` costs 2-3 us of host time on the H200's host, an eager
    plan's whole copy is 10."""
    return bool(_state["on"]) and switch_on(_state, "FORWARD_PLANNER_RAW_COPY")


@functools.lru_cache(maxsize=1)
def _memcpy_async() -> Callable[..., int] | None:
    """``cudaMemcpyAsync`` of torch's own runtime library, or None.

    torch loads its CUDA runtime into the global symbol scope before any extension, so the
    global lookup finds torch's even when an extension mapped another copy (which would be
    another runtime). Without the global symbol, the one library mapped, if only one is."""
    try:
        fn = ctypes.CDLL(None).cudaMemcpyAsync
    except (OSError, AttributeError):
        path = _loaded_cudart()
        if path is None:
            return None
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def memcpy_address() -> int | None:
    """The address of torch's ``cudaMemcpyAsync`` where copies take the runtime's call (for
    the eager lane's C submission, ``planner.lane_submit``), else None."""
    fn = _memcpy_async() if enabled() else None
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _loaded_cudart() -> str | None:
    """The path of the one CUDA runtime library mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            return cudart_in(maps)
    except OSError:
        return None


def cudart_in(maps: Iterable[str]) -> str | None:
    """The CUDA runtime library's path among ``/proc/self/maps`` lines; None where there is
    none, or more than one (which is torch's the addresses do not say)."""
    found = set()
    for line in maps:
        path = line.rstrip("\n").partition("/")[2]
        if path and path.rsplit("/", 1)[-1].startswith("libcudart.so"):
            found.add("/" + path)
    return found.pop() if len(found) == 1 else None


def send(dst: torch.Tensor, src: torch.Tensor, numel: int, device_index: int) -> None:
    """The first ``numel`` int32 elements of pinned ``src`` into the first of ``dst``, on the
    current stream of CUDA device ``device_index``, asynchronously."""
    if not 0 <= numel <= min(dst.shape[0], src.shape[0]):  # never past either buffer's end
        raise ValueError(
            f"staging copy of {numel} elements between buffers of "
            f"{src.shape[0]} (host) and {dst.shape[0]} (device)"
        )
    fn = _memcpy_async() if enabled() else None
    if fn is not None and torch._C._cuda_getDevice() == device_index:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        error = fn(dst.data_ptr(), src.data_ptr(), numel * _INT32_BYTES, _HOST_TO_DEVICE, stream)
        if error == 0:
            return
        _state["on"] = False
        warn_once(
            f"cudaMemcpyAsync failed (error {error}); staging copies go through "
            "Tensor.copy_ from now on"
        )
    whole = numel == dst.numel() == src.numel()
    (dst if whole else dst[:numel]).copy_(src if whole else src[:numel], non_blocking=True)
