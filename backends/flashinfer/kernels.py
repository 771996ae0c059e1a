"""Triton kernels for FlashInfer's paged-KV metadata, bit-identical to the torch references.

FlashInfer reads a ragged page list: request ``r``'s pages are
``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]``. Built with torch ops that is a
gather, a mask and a scatter over ``[reqs, pages]`` temporaries; here it is one
launch that writes every element of the static buffer (the ragged prefix and a
zero tail), so a replayed graph never reads a page id left over from a longer
batch. The two per-request tables (pages per request, last page length) are
one elementwise launch each.

Kernels are handed to ``triton.jit`` on first launch, not at import, for the
reason ``backends.common.triton_kernels`` gives: ``triton.jit`` fixes
interpreter-or-compiler when it decorates, and tests switch the interpreter on
with ``TRITON_INTERPRET=1`` after some other module may have imported this one.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, block_size, triton_available
from backends.flashinfer import reference as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["last_page_len", "paged_kv_indices", "pages_per_request", "triton_usable"]

triton_usable = triton_available


def _require(device: torch.device) -> None:
    if not triton_usable(device):
        raise RuntimeError(
            f"Triton kernels cannot run on {device}: they need CUDA, or CPU tensors"
            " with TRITON_INTERPRET=1"
        )


# --- kernels -----------------------------------------------------------------------


def _page_split_kernel(out_ptr, seq_ptr, n, page_size, LAST: tl.constexpr, BLOCK: tl.constexpr):
    # Lengths were validated >= 1 at the planner's door, so (len - 1) is never negative
    # and truncating division equals floor division here.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    length = tl.load(seq_ptr + offs, mask=mask, other=1)
    if LAST:  # noqa: SIM108 - a constexpr branch: Triton compiles only the one taken
        value = (length - 1) % page_size + 1
    else:
        value = (length + page_size - 1) // page_size
    tl.store(out_ptr + offs, value, mask=mask)


def _kv_indices_kernel(
    out_ptr,
    r2t_ptr,
    pool_ptr,
    indptr_ptr,
    reqs,
    width,
    numel,
    ctx,
    r2t_stride,
    page_size,
    BLOCK: tl.constexpr,
):
    # Grid: (page blocks, requests). Each program writes request `row`'s pages into
    # the ragged prefix and zeroes the flat positions row * width + p that lie past
    # the prefix: the two target sets are disjoint and together cover the buffer.
    # Offsets are int64: reqs * width and pool * stride can pass 2**31.
    row = tl.program_id(1).to(tl.int64)
    page = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = page < width
    start = tl.load(indptr_ptr + row)
    count = tl.load(indptr_ptr + row + 1) - start
    total = tl.load(indptr_ptr + reqs)
    col = page.to(tl.int64) * page_size
    take = in_row & (page < count) & (col < ctx)
    pool = tl.load(pool_ptr + row).to(tl.int64)
    slot = tl.load(r2t_ptr + pool * r2t_stride + col, mask=take, other=0)
    quot = slot // page_size
    quot = tl.where(quot * page_size > slot, quot - 1, quot)  # floor, as torch does
    dest = start.to(tl.int64) + page
    tl.store(out_ptr + dest, quot, mask=in_row & (page < count) & (dest < numel))
    flat = row * width + page
    tl.store(out_ptr + flat, tl.zeros([BLOCK], tl.int32), mask=in_row & (flat >= total))


_page_split = LazyKernel(_page_split_kernel)
_kv_indices = LazyKernel(_kv_indices_kernel)


# --- launchers ---------------------------------------------------------------------


def pages_per_request(out: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """See ``reference.pages_per_request``."""
    ref.check_per_request(out, seq_lens, page_size)
    _require(out.device)
    n = out.shape[0]
    if n:
        block = block_size(n)
        _page_split[(triton.cdiv(n, block),)](out, seq_lens, n, page_size, LAST=False, BLOCK=block)


def last_page_len(out: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """See ``reference.last_page_len``."""
    ref.check_per_request(out, seq_lens, page_size)
    _require(out.device)
    n = out.shape[0]
    if n:
        block = block_size(n)
        _page_split[(triton.cdiv(n, block),)](out, seq_lens, n, page_size, LAST=True, BLOCK=block)


def paged_kv_indices(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> None:
    """See ``reference.paged_kv_indices``; one launch, grid (page blocks, requests)."""
    width = ref.check_paged_kv_indices(out, req_to_token, req_pool_indices, kv_indptr, page_size)
    _require(out.device)
    reqs = kv_indptr.shape[0] - 1
    if reqs == 0 or width == 0:
        out.zero_()
        return
    block = block_size(width)
    _kv_indices[(triton.cdiv(width, block), reqs)](
        out,
        req_to_token,
        req_pool_indices,
        kv_indptr,
        reqs,
        width,
        out.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0),
        page_size,
        BLOCK=block,
    )
