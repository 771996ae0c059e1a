"""Exact PyTorch references for FlashInfer's paged-KV metadata, and their argument checks.

FlashInfer describes each request's KV by a ragged page list (``kv_indptr``,
``kv_indices``) plus either the length of the last page (decode wrapper) or
the token count (MLA wrapper). These references define those tables exactly;
the Triton kernels in ``backends.flashinfer.kernels`` must equal them bit for
bit. They stay graph-safe like every reference here: shapes come from tensor
metadata only, results land in the caller's ``out`` and nothing is read back
to the host. Integer division truncates (C semantics), as Triton's does, so
the two agree on every int32 input, not only on the valid ones.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_paged_kv_indices",
    "check_per_request",
    "last_page_len",
    "paged_kv_indices",
    "pages_per_request",
]

_I32_MAX = 2**31 - 1


def _check_i32(name: str, t: torch.Tensor, ndim: int, *, rows_strided: bool = False) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    dense = t.stride(-1) == 1 if rows_strided else t.is_contiguous()
    if not dense:  # kernels index rows by stride(0) and columns densely
        raise ValueError(f"{name} must be contiguous" + (" along its rows" if rows_strided else ""))


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if not 1 <= page_size <= _I32_MAX:
        raise ValueError(f"page_size must lie in [1, {_I32_MAX}], got {page_size}")


def _check_device(out: torch.Tensor, *others: torch.Tensor) -> None:
    for t in others:
        if t.device != out.device:
            raise ValueError(f"all tensors must be on {out.device}, got one on {t.device}")


def check_per_request(out: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """``out`` and ``seq_lens``: int32 ``[reqs]`` on one device; a positive page size."""
    _check_i32("out", out, 1)
    _check_i32("seq_lens", seq_lens, 1)
    _check_device(out, seq_lens)
    _check_page_size(page_size)
    if out.shape != seq_lens.shape:
        raise ValueError(f"out {tuple(out.shape)} and seq_lens {tuple(seq_lens.shape)} differ")


def check_paged_kv_indices(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> int:
    """Checks shapes (metadata only, capture-safe); returns the page capacity per request."""
    _check_i32("out", out, 1)
    _check_i32("req_to_token", req_to_token, 2, rows_strided=True)
    _check_i32("kv_indptr", kv_indptr, 1)
    _check_page_size(page_size)
    if req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"req_pool_indices must be int32 or int64, got {req_pool_indices.dtype}")
    if req_pool_indices.dim() != 1 or not req_pool_indices.is_contiguous():
        raise ValueError("req_pool_indices must be 1-D and contiguous")
    _check_device(out, req_to_token, req_pool_indices, kv_indptr)
    reqs = kv_indptr.shape[0] - 1
    if reqs < 0:
        raise ValueError("kv_indptr needs reqs + 1 >= 1 entries")
    if req_pool_indices.shape[0] != reqs:
        raise ValueError(
            f"kv_indptr describes {reqs} requests but req_pool_indices has"
            f" {req_pool_indices.shape[0]}"
        )
    if reqs == 0:
        return 0
    if out.shape[0] % reqs:
        raise ValueError(
            f"out holds {out.shape[0]} entries, not a multiple of {reqs} requests"
            " (a flat [reqs * pages] buffer is expected)"
        )
    return out.shape[0] // reqs


def pages_per_request(out: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """``out[r] = ceil(seq_lens[r] / page_size)``: the length of request r's page list.

    Its prefix sum is ``kv_indptr``. Padding requests (length ``next_n``) get at
    least one page, the null page, so FlashInfer never sees an empty request.
    """
    check_per_request(out, seq_lens, page_size)
    torch.div(seq_lens + (page_size - 1), page_size, rounding_mode="trunc", out=out)


def last_page_len(out: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """``out[r] = (seq_lens[r] - 1) % page_size + 1``: tokens in request r's last page.

    FlashInfer's decode wrapper derives each KV length as
    ``(pages - 1) * page_size + last_page_len``; this is the value in [1, page_size]
    that makes that equal ``seq_lens[r]``.
    """
    check_per_request(out, seq_lens, page_size)
    torch.fmod(seq_lens - 1, page_size, out=out)
    out.add_(1)


def paged_kv_indices(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> None:
    """FlashInfer's flat page list, written over the whole static buffer.

    With ``width = len(out) // reqs`` and ``count[r] = kv_indptr[r+1] - kv_indptr[r]``
    (``kv_indptr`` must be a prefix sum of counts in [0, width]):
    ``out[kv_indptr[r] + p] = req_to_token[req_pool_indices[r], p * page_size] // page_size``
    for ``p < count[r]`` (0 where ``p * page_size`` is past the table's width), and every
    other element is 0, the null page. Pages are contiguous slot runs, so the first slot
    names the page. The tail is zeroed rather than left alone because a captured buffer
    is reused by smaller batches: stale page ids there would be one off-by-one away
    from being read.
    """
    width = check_paged_kv_indices(out, req_to_token, req_pool_indices, kv_indptr, page_size)
    reqs = kv_indptr.shape[0] - 1
    numel = out.shape[0]
    if reqs == 0 or width == 0:
        out.zero_()
        return
    device = out.device
    page = torch.arange(width, device=device, dtype=torch.int64)
    start = kv_indptr[:-1].to(torch.int64)
    count = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    ctx = req_to_token.shape[1]
    col = page * page_size
    write = page[None, :] < count[:, None]
    take = write & (col[None, :] < ctx)
    if ctx:
        rows = req_pool_indices.to(torch.int64)[:, None].expand(reqs, width)
        slots = req_to_token[rows, col.clamp(max=ctx - 1)[None, :].expand(reqs, width)]
        slots = torch.where(take, slots, torch.zeros_like(slots))
    else:  # a table without columns: every page reads as the null slot
        slots = torch.zeros((reqs, width), dtype=torch.int32, device=device)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    dest = start[:, None] + page[None, :]
    write &= dest < numel
    trash = torch.full_like(dest, numel)  # one extra element absorbs every masked write
    flat = torch.zeros(numel + 1, dtype=torch.int32, device=device)
    flat.scatter_(0, torch.where(write, dest, trash).reshape(-1), pages.reshape(-1))
    out.copy_(flat[:numel])
