"""The host arrays FlashInfer's scheduler reads, filled once per batch.

Every FlashInfer replay fills them (lengths padded to the planned size, pages per request
and their prefix sum, the last page's tokens, the query offsets, a summary), so their cost
is paid per step: a dozen numpy calls cost about 13 us on a fast host and two to three
times that on the GPU hosts we measure. ``host_args.c`` fills them in one C call
built through :mod:`planner.native`; the numpy fill stays the authority, runs whenever the
C fill is unavailable or declines a batch, and is what the tests hold the C fill to.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import numpy as np
import torch

from planner import native
from planner.errors import ProviderError

_SOURCE = Path(__file__).resolve().with_suffix(".c")
_INT32 = torch.int32
_ARGS = struct.Struct("=10q")
"""The C fill's packed arguments (``A_*`` in the source)."""


@functools.cache
def _c_fill():
    """``fp_fi_host_args`` as a ctypes function, or None (no compiler, or switched off)."""
    lib = native.load("fp_flashinfer", (_SOURCE,), "compiled FlashInfer host arrays")
    if lib is None:
        return None
    fn = lib.fp_fi_host_args
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int64]
    return fn


class HostArgs:
    """Host copies of the arrays FlashInfer's ``plan`` reads, for up to ``capacity`` requests.

    Pinned on CUDA so FlashInfer's ``non_blocking`` copies out of them are truly
    asynchronous (a pageable source may make the driver synchronise).
    """

    def __init__(self, capacity: int, pin: bool, *, compiled: bool = True) -> None:
        self.capacity = capacity
        i32 = {"dtype": torch.int32, "pin_memory": pin}
        self._qo_indptr = torch.zeros(capacity + 1, **i32)
        self._kv_indptr = torch.zeros(capacity + 1, **i32)
        self._last_page_len = torch.zeros(capacity, **i32)
        self._kv_lens = torch.zeros(capacity, **i32)
        self.summary = torch.zeros(4, dtype=torch.int64, pin_memory=pin)
        # numpy views of the same memory, made once: every replay fills them
        self._np = [t.numpy() for t in (self._qo_indptr, self._kv_indptr, self._last_page_len)]
        self._lens_np, self.summary_np = self._kv_lens.numpy(), self.summary.numpy()
        self._pages = np.zeros(capacity, dtype=np.int32)
        self._qo_for: tuple[int, int] | None = None
        self._cut(0)
        self._fn = _c_fill() if compiled else None
        self._packed = ctypes.create_string_buffer(_ARGS.size)
        self._packed_at = ctypes.addressof(self._packed)
        self._outs = tuple(
            t.data_ptr()
            for t in (
                self._qo_indptr,
                self._kv_indptr,
                self._last_page_len,
                self._kv_lens,
                self.summary,
            )
        )

    def fill(self, seq_lens_cpu: torch.Tensor, reqs: int, page_size: int, next_n: int) -> None:
        """The batch's lengths padded to ``reqs`` with ``next_n`` (the plans' pad), then the tables."""
        real = seq_lens_cpu.shape[0]
        if not real <= reqs <= self.capacity:
            raise ProviderError(
                "batch does not fit the planned size",
                field="seq_lens_cpu",
                expected=f"<= {reqs}",
                actual=real,
            )
        if reqs != self.reqs:
            self._cut(reqs)
        fn = self._fn
        if (
            fn is not None
            and seq_lens_cpu.dtype is _INT32
            and seq_lens_cpu.is_contiguous()
            and seq_lens_cpu.is_cpu
        ):
            src = seq_lens_cpu.data_ptr()
            _ARGS.pack_into(self._packed, 0, src, real, reqs, page_size, next_n, *self._outs)
            if fn(self._packed_at) == 0:
                self._qo_for = (reqs, next_n)  # the C fill wrote the query offsets too
                return
        self._fill_numpy(seq_lens_cpu, reqs, page_size, next_n)

    def _fill_numpy(
        self, seq_lens_cpu: torch.Tensor, reqs: int, page_size: int, next_n: int
    ) -> None:
        """Numpy in place on views made once: a dozen tiny torch ops (or fresh numpy
        temporaries) would cost more host time than the whole plan."""
        real = seq_lens_cpu.shape[0]
        qo, indptr, last = (a[: reqs + 1] for a in self._np)
        lens, pages = self._lens_np[:reqs], self._pages[:reqs]
        lens[:real] = seq_lens_cpu.numpy()
        lens[real:] = next_n
        np.add(lens, page_size - 1, out=pages)
        np.floor_divide(pages, page_size, out=pages)
        indptr[0] = 0
        np.cumsum(pages, dtype=np.int32, out=indptr[1:])
        last = last[:reqs]
        np.subtract(lens, 1, out=last)
        np.remainder(last, page_size, out=last)
        last += 1
        if self._qo_for != (reqs, next_n):  # the same for every batch of this size and mode
            np.multiply(np.arange(reqs + 1, dtype=np.int32), next_n, out=qo)
            self._qo_for = (reqs, next_n)
        self.summary_np[:] = (reqs, int(indptr[reqs]), int(lens.sum(dtype=np.int64)), lens.max())

    def _cut(self, reqs: int) -> None:
        """Views of ``reqs`` requests (what FlashInfer's scheduler reads), made when the size
        changes: a graph slot's never does, and slicing four tensors per replay costs
        several us."""
        self.reqs = reqs
        self.qo_indptr = self._qo_indptr[: reqs + 1]
        self.kv_indptr = self._kv_indptr[: reqs + 1]
        self.last_page_len = self._last_page_len[:reqs]
        self.kv_lens = self._kv_lens[:reqs]

    @property
    def total_pages(self) -> int:
        return int(self._kv_indptr.numpy()[self.reqs])
