"""The host arrays FlashInfer's scheduler reads, filled once per batch.

Every FlashInfer replay fills them (lengths padded to the planned size, pages per request
and their prefix sum, the last page's tokens, the query offsets, a summary), so their cost
is paid per step: numpy in place on views made once, a dozen calls.
"""

from __future__ import annotations

import numpy as np
import torch

from planner.errors import ProviderError


class HostArgs:
    """Host copies of the arrays FlashInfer's ``plan`` reads, for up to ``capacity`` requests.

    Pinned on CUDA so FlashInfer's ``non_blocking`` copies out of them are truly
    asynchronous (a pageable source may make the driver synchronise).
    """

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        i32 = {"dtype": torch.int32, "pin_memory": pin}
        self._qo_indptr = torch.zeros(capacity + 1, **i32)
        self._kv_indptr = torch.zeros(capacity + 1, **i32)
        self._last_page_len = torch.zeros(capacity, **i32)
        self._kv_lens = torch.zeros(capacity, **i32)
        self.summary = torch.zeros(4, dtype=torch.int64, pin_memory=pin)
        # numpy views of the same memory, made once: every replay fills them
        self._np = [t.numpy() for t in (self._qo_indptr, self._kv_indptr, self._last_page_len)]
        self._lens_np, self._summary_np = self._kv_lens.numpy(), self.summary.numpy()
        self._pages = np.zeros(capacity, dtype=np.int32)
        self._qo_for: tuple[int, int] | None = None
        self._cut(0)

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
        # Numpy in place on views made once: a dozen tiny torch ops (or fresh numpy
        # temporaries) would cost more host time than the whole plan.
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
        self._summary_np[:] = (reqs, int(indptr[reqs]), int(lens.sum(dtype=np.int64)), lens.max())

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
