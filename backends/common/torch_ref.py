"""Exact PyTorch references for the metadata kernels.

These are the ground truth the Triton kernels are tested against, and the fallback
wherever Triton is unavailable, so they stay graph-safe: shapes come only from tensor
metadata, results land in the caller's ``out`` (whose address a CUDA graph bakes in),
and nothing reads a device value back to the host. Temporaries are allowed; under
capture they come from the graph's private pool.
"""

from __future__ import annotations

import torch

__all__ = [
    "causal_lengths",
    "clamp_into",
    "cumsum_with_zero",
    "gather_token_slots",
    "page_table_from_slots",
    "uniform_offsets",
]

_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1


def _check_i32(name: str, t: torch.Tensor, ndim: int) -> None:
    # Checks read metadata only, so they cost no sync and are safe during capture.
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_device(out: torch.Tensor, *others: torch.Tensor) -> None:
    for t in others:
        if t.device != out.device:
            raise ValueError(f"all tensors must be on {out.device}, got one on {t.device}")


def _check_scalar(name: str, value: int, lo: int = _I32_MIN) -> None:
    # A Python int outside int32 would silently widen inside the kernels; refuse it.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= _I32_MAX:
        raise ValueError(f"{name} must lie in [{lo}, {_I32_MAX}], got {value}")


def check_cumsum_with_zero(out: torch.Tensor, x: torch.Tensor) -> None:
    _check_i32("out", out, 1)
    _check_i32("x", x, 1)
    _check_device(out, x)
    if out.shape[0] != x.shape[0] + 1:
        raise ValueError(f"out needs len(x) + 1 = {x.shape[0] + 1} entries, has {out.shape[0]}")


def check_clamp_into(out: torch.Tensor, x: torch.Tensor, lo: int | None, hi: int | None) -> None:
    _check_i32("out", out, 1)
    _check_i32("x", x, 1)
    _check_device(out, x)
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} and x {tuple(x.shape)} differ in shape")
    if lo is not None:
        _check_scalar("lo", lo)
    if hi is not None:
        _check_scalar("hi", hi)


def check_uniform_offsets(out: torch.Tensor, step: int) -> None:
    _check_i32("out", out, 1)
    _check_scalar("step", step)


def check_gather_token_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _check_i32("out", out, 2)
    _check_i32("req_to_token", req_to_token, 2)
    _check_i32("seq_lens", seq_lens, 1)
    if req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"req_pool_indices must be int32 or int64, got {req_pool_indices.dtype}")
    if req_pool_indices.dim() != 1 or not req_pool_indices.is_contiguous():
        raise ValueError("req_pool_indices must be 1-D and contiguous")
    _check_device(out, req_to_token, req_pool_indices, seq_lens)
    reqs = out.shape[0]
    if req_pool_indices.shape[0] != reqs or seq_lens.shape[0] != reqs:
        raise ValueError(
            f"out has {reqs} rows but req_pool_indices has {req_pool_indices.shape[0]}"
            f" and seq_lens {seq_lens.shape[0]}"
        )


def check_page_table_from_slots(
    out: torch.Tensor, token_slots: torch.Tensor, page_size: int
) -> None:
    _check_i32("out", out, 2)
    _check_i32("token_slots", token_slots, 2)
    _check_device(out, token_slots)
    _check_scalar("page_size", page_size, lo=1)
    if out.shape[0] != token_slots.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows but token_slots has {token_slots.shape[0]}")


def check_causal_lengths(out: torch.Tensor, seq_lens: torch.Tensor, next_n: int) -> None:
    _check_i32("out", out, 1)
    _check_i32("seq_lens", seq_lens, 1)
    _check_device(out, seq_lens)
    _check_scalar("next_n", next_n, lo=1)
    if out.shape[0] != seq_lens.shape[0] * next_n:
        raise ValueError(
            f"out needs len(seq_lens) * next_n = {seq_lens.shape[0] * next_n} entries,"
            f" has {out.shape[0]}"
        )


def cumsum_with_zero(out: torch.Tensor, x: torch.Tensor) -> None:
    """Exclusive-prefix layout (leading zero) because attention kernels index
    request ``r``'s tokens as ``[out[r], out[r + 1])``; the sum stays int32, wrapping
    exactly like the Triton kernel, instead of torch's default promotion to int64."""
    check_cumsum_with_zero(out, x)
    out[:1].zero_()
    torch.cumsum(x, 0, dtype=torch.int32, out=out[1:])


def clamp_into(out: torch.Tensor, x: torch.Tensor, lo: int | None, hi: int | None) -> None:
    """``torch.clamp`` refuses two missing bounds; a plan may legitimately have none,
    so that case degrades to a copy. With ``lo > hi`` the result is ``hi``, as in
    ``torch.clamp``."""
    check_clamp_into(out, x, lo, hi)
    if lo is None and hi is None:
        out.copy_(x)
    else:
        torch.clamp(x, min=lo, max=hi, out=out)


def uniform_offsets(out: torch.Tensor, step: int) -> None:
    """Decode and fixed-draft verify batches have the same query length per request,
    so their cumulative offsets need no input tensor at all."""
    check_uniform_offsets(out, step)
    torch.arange(out.shape[0], out=out)
    out.mul_(step)


def gather_token_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Zeroing past each length (slot 0 is the null slot) keeps stale slots of a
    padded or shrunk request from being read by a replayed graph. Columns at or past
    ``ctx`` are never read from ``req_to_token``; the caller guarantees
    ``seq_lens <= ctx``."""
    check_gather_token_slots(out, req_to_token, req_pool_indices, seq_lens)
    width = out.shape[1]
    k = min(width, req_to_token.shape[1])
    if k < width:
        out[:, k:].zero_()
    if k == 0 or out.shape[0] == 0:
        return
    head = out[:, :k]
    torch.index_select(req_to_token[:, :k], 0, req_pool_indices, out=head)
    cols = torch.arange(k, device=out.device, dtype=torch.int32)
    head.masked_fill_(cols.unsqueeze(0) >= seq_lens.unsqueeze(1), 0)


def page_table_from_slots(out: torch.Tensor, token_slots: torch.Tensor, page_size: int) -> None:
    """The first slot of each page names the page (pages are contiguous slot runs),
    so one strided read per page suffices. Floor division keeps null slot 0 on null
    page 0; pages past the row's width are 0 too."""
    check_page_table_from_slots(out, token_slots, page_size)
    pages = out.shape[1]
    k = min(pages, -(-token_slots.shape[1] // page_size))
    if k < pages:
        out[:, k:].zero_()
    if k == 0 or out.shape[0] == 0:
        return
    firsts = token_slots[:, ::page_size][:, :k]
    torch.div(firsts, page_size, rounding_mode="floor", out=out[:, :k])


def causal_lengths(out: torch.Tensor, seq_lens: torch.Tensor, next_n: int) -> None:
    """Speculative verify scores ``next_n`` draft tokens per request in one pass;
    token ``i`` may only attend to the KV up to itself, hence the per-token
    lengths ``seq_len - (next_n - 1 - i)``."""
    check_causal_lengths(out, seq_lens, next_n)
    back = torch.arange(next_n - 1, -1, -1, device=out.device, dtype=torch.int32)
    torch.sub(seq_lens.unsqueeze(1), back, out=out.view(seq_lens.shape[0], next_n))
