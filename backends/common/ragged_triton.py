"""Triton versions of the ragged (per-token) metadata ops, bit-identical to ``ragged_ref``.

Each output element finds its owning request itself, by a binary search over the
offsets (``qo_indptr`` or ``kv_indptr``) of a fixed ``reqs.bit_length()`` steps: the work
per element is bounded by the shapes, one long request cannot stall a program (as a
program per request walking its tokens would), and padding elements are written by the
same program as real ones. The search counts the offsets ``indptr[1..reqs]`` that are
``<= t``, exactly what ``torch.searchsorted(indptr[1:], t, right=True)`` computes in the
reference, and clamps into ``[0, reqs)``, so every load stays in bounds whatever the
values.

Launchers share the references' signatures and checks, derive their grids from
shapes only (no host sync, capturable) and reuse ``triton_kernels``' lazy decoration, so
they run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how they are tested.
"""

from __future__ import annotations

import torch

from backends.common import ragged_ref as ref
from backends.common import triton_kernels as tri
from backends.common.triton_kernels import LazyKernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = [
    "kv_gather_slots",
    "last_token_rows",
    "slot_pages",
    "token_causal_lengths",
    "token_kv_ranges",
    "token_positions",
    "token_request",
    "token_topk_lengths",
]

# One block size for every launch: these kernels run in eager extend plans, whose sizes
# change every batch, and each block size is one more compile mid-serving.
_BLOCK = 1024

# What the per-token kernel writes (a compile-time switch: one search, five outputs).
_REQUEST, _POSITION, _CAUSAL, _TOPK, _RANGES = range(5)


def _token_kernel(
    out_ptr,
    qo_ptr,
    aux_ptr,
    reqs,
    n,
    steps,
    pad,
    topk,
    out_stride,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # aux is seq_lens [reqs] for positions and lengths, kv_indptr [reqs + 1] for ranges.
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_out = t < n
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + reqs
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) >> 1
        start = tl.load(qo_ptr + mid + 1, mask=active & in_out, other=0)
        right = active & (start <= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, tl.where(active, mid, hi))
    b = tl.minimum(lo, reqs - 1)
    total = tl.load(qo_ptr + reqs)
    real = in_out & (t < total) & (b >= 0)  # b is -1 when there are no requests
    if KIND == 0:  # _REQUEST
        tl.store(out_ptr + t, tl.where(real, b, pad), mask=in_out)
    else:
        q_end = tl.load(qo_ptr + b + 1, mask=real, other=0)
        if KIND == 4:  # _RANGES
            ks = tl.load(aux_ptr + b, mask=real, other=0)
            kv_end = tl.load(aux_ptr + b + 1, mask=real, other=0)
            tl.store(out_ptr + t, tl.where(real, ks, 0), mask=in_out)
            ke = kv_end - q_end + t + 1
            tl.store(out_ptr + out_stride + t, tl.where(real, ke, 1), mask=in_out)
        else:
            pos = tl.load(aux_ptr + b, mask=real, other=0) - q_end + t
            if KIND == 1:  # _POSITION
                tl.store(out_ptr + t, tl.where(real, pos, 0), mask=in_out)
            elif KIND == 2:  # _CAUSAL
                tl.store(out_ptr + t, tl.where(real, pos + 1, 1), mask=in_out)
            else:  # _TOPK
                tl.store(out_ptr + t, tl.where(real, tl.minimum(pos + 1, topk), 1), mask=in_out)


def _kv_gather_kernel(
    out_ptr, r2t_ptr, idx_ptr, kv_ptr, reqs, cap, ctx, r2t_stride, steps, BLOCK: tl.constexpr
):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_out = p < cap
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + reqs
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) >> 1
        start = tl.load(kv_ptr + mid + 1, mask=active & in_out, other=0)
        right = active & (start <= p)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, tl.where(active, mid, hi))
    b = tl.minimum(lo, reqs - 1)
    total = tl.load(kv_ptr + reqs)
    real = in_out & (p < total) & (b >= 0)
    j = p - tl.load(kv_ptr + b, mask=real, other=0)
    take = real & (j >= 0) & (j < ctx)
    # pool * stride can pass int32 on a large request pool.
    pool = tl.load(idx_ptr + b, mask=take, other=0).to(tl.int64)
    slot = tl.load(r2t_ptr + pool * r2t_stride + j, mask=take, other=0)
    tl.store(out_ptr + p, slot, mask=in_out)


def _last_rows_kernel(out_ptr, qo_ptr, reqs, n, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # element b * n + i of out
    keep = e < reqs * n
    b = e // n
    start = tl.load(qo_ptr + b, mask=keep, other=0)
    end = tl.load(qo_ptr + b + 1, mask=keep, other=1)
    row = tl.minimum(tl.maximum(end - n + e % n, start), end - 1)
    tl.store(out_ptr + e, row, mask=keep)


def _slot_pages_kernel(out_ptr, loc_ptr, n, page_size, out_stride, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = t < n
    loc = tl.load(loc_ptr + t, mask=keep, other=0)
    page = loc // page_size  # slots are never negative: floor and truncation agree
    tl.store(out_ptr + t, page, mask=keep)
    tl.store(out_ptr + out_stride + t, loc - page * page_size, mask=keep)


_token = LazyKernel(_token_kernel)
_kv_gather = LazyKernel(_kv_gather_kernel)
_last_rows = LazyKernel(_last_rows_kernel)
_slot_pages = LazyKernel(_slot_pages_kernel)


def _launch_token(
    kind: int,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    aux: torch.Tensor,
    pad: int = 0,
    topk: int = 1,
) -> None:
    tri._require(out.device)
    n = out.shape[-1]
    if n == 0:
        return
    reqs = qo_indptr.shape[0] - 1
    _token.launch(
        (triton.cdiv(n, _BLOCK),),
        out,
        qo_indptr,
        aux,
        reqs,
        n,
        reqs.bit_length(),  # steps: enough to narrow reqs + 1 candidates to one
        pad,
        topk,
        out.stride(0) if out.dim() == 2 else 0,
        KIND=kind,
        BLOCK=_BLOCK,
    )


def token_request(out: torch.Tensor, qo_indptr: torch.Tensor, pad: int) -> None:
    """See ``ragged_ref.token_request``."""
    ref.check_token_request(out, qo_indptr, pad)
    _launch_token(_REQUEST, out, qo_indptr, qo_indptr, pad=pad)


def token_positions(out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """See ``ragged_ref.token_positions``."""
    ref.check_token_op(out, qo_indptr, seq_lens)
    _launch_token(_POSITION, out, qo_indptr, seq_lens)


def token_causal_lengths(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """See ``ragged_ref.token_causal_lengths``."""
    ref.check_token_op(out, qo_indptr, seq_lens)
    _launch_token(_CAUSAL, out, qo_indptr, seq_lens)


def token_topk_lengths(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor, topk: int
) -> None:
    """See ``ragged_ref.token_topk_lengths``."""
    ref.check_token_topk_lengths(out, qo_indptr, seq_lens, topk)
    _launch_token(_TOPK, out, qo_indptr, seq_lens, topk=topk)


def token_kv_ranges(out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor) -> None:
    """See ``ragged_ref.token_kv_ranges``; both rows from one launch."""
    ref.check_token_kv_ranges(out, qo_indptr, kv_indptr)
    _launch_token(_RANGES, out, qo_indptr, kv_indptr)


def kv_gather_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """See ``ragged_ref.kv_gather_slots``."""
    reqs = ref.check_kv_gather_slots(out, req_to_token, req_pool_indices, kv_indptr)
    tri._require(out.device)
    cap = out.shape[0]
    if cap == 0:
        return
    _kv_gather.launch(
        (triton.cdiv(cap, _BLOCK),),
        out,
        req_to_token,
        req_pool_indices,
        kv_indptr,
        reqs,
        cap,
        req_to_token.shape[1],
        req_to_token.stride(0),
        reqs.bit_length(),
        BLOCK=_BLOCK,
    )


def last_token_rows(out: torch.Tensor, qo_indptr: torch.Tensor) -> None:
    """See ``ragged_ref.last_token_rows``."""
    reqs = ref.check_last_token_rows(out, qo_indptr)
    tri._require(out.device)
    if reqs == 0:
        return
    n = out.shape[1] if out.dim() == 2 else 1
    _last_rows.launch((triton.cdiv(reqs * n, _BLOCK),), out, qo_indptr, reqs, n, BLOCK=_BLOCK)


def slot_pages(out: torch.Tensor, out_cache_loc: torch.Tensor, page_size: int) -> None:
    """See ``ragged_ref.slot_pages``."""
    n = ref.check_slot_pages(out, out_cache_loc, page_size)
    tri._require(out.device)
    if n == 0:
        return
    _slot_pages.launch(
        (triton.cdiv(n, _BLOCK),), out, out_cache_loc, n, page_size, out.stride(0), BLOCK=_BLOCK
    )
