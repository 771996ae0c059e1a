"""Exact PyTorch references for the per-token (ragged) metadata of extend / prefill batches.

A batch has ``reqs`` requests; request ``b`` has KV length ``seq_lens[b]`` (cached prefix
plus new tokens) and ``extend_lens[b] >= 1`` new tokens, laid out request-major, so token
``t`` belongs to the request ``b`` with ``qo_indptr[b] <= t < qo_indptr[b + 1]``
(``qo_indptr = cumsum_with_zero(extend_lens)``). Its position is the prefix length plus
its offset in the request. The query dimension is padded to a static ``max_tokens``, and
the flat gathered KV (every request's KV in request order, ``kv_indptr =
cumsum_with_zero(seq_lens)``) to a static capacity: tokens ``t >= qo_indptr[reqs]`` and KV
entries ``>= kv_indptr[reqs]`` are padding and get the valid values each op documents, so
a kernel reading a padding row never reads out of bounds.

The ops take the offsets rather than ``extend_lens``: ``extend_lens[b] = qo_indptr[b + 1] -
qo_indptr[b]`` and ``seq_lens[b] = kv_indptr[b + 1] - kv_indptr[b]``, so lengths and offsets
that disagree cannot be passed. Offsets must be non-decreasing (they are cumulative sums of
positive lengths, which the planner checks at its door); with any values every op still
writes every element and reads only in bounds.

Like ``torch_ref``, these are graph-safe: shapes come from tensor metadata only, results
land in the caller's ``out``, nothing reads a device value back to the host.
"""

from __future__ import annotations

import torch

from planner.errors import PlanError

__all__ = [
    "check_kv_gather_slots",
    "check_last_token_rows",
    "check_slot_pages",
    "last_token_rows",
    "slot_pages",
    "check_token_kv_ranges",
    "check_token_op",
    "check_token_request",
    "check_token_topk_lengths",
    "kv_gather_slots",
    "token_causal_lengths",
    "token_kv_ranges",
    "token_positions",
    "token_request",
    "token_topk_lengths",
]

I32 = torch.int32
_I32_MAX = 2**31 - 1


def _shape(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)}"


def _check_i32(field: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] = (I32,)) -> None:
    # Metadata only: no sync, safe during capture.
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise PlanError(f"must be {names}", field=field, expected=names, actual=_shape(t))
    if t.dim() != ndim:
        raise PlanError(f"must be {ndim}-D", field=field, expected=f"{ndim}-D", actual=_shape(t))
    if not t.is_contiguous():
        raise PlanError("must be contiguous", field=field, expected="contiguous", actual=t.stride())


def _check_length(field: str, t: torch.Tensor, length: int, what: str) -> None:
    if t.shape[0] != length:
        raise PlanError(f"needs {what} entries", field=field, expected=length, actual=t.shape[0])


def _check_indptr(field: str, t: object) -> int:
    """A ``[reqs + 1]`` offsets tensor; returns ``reqs``."""
    _check_i32(field, t, 1)
    if t.shape[0] < 1:
        raise PlanError("offsets start with a leading 0", field=field, expected=">= 1", actual=0)
    return t.shape[0] - 1


def _check_device(out: torch.Tensor, **others: torch.Tensor) -> None:
    for field, t in others.items():
        if t.device != out.device:
            raise PlanError(
                "must be on out's device", field=field, expected=out.device, actual=t.device
            )


def _check_scalar(field: str, value: object, lo: int) -> None:
    # A Python int outside int32 would silently widen inside the kernels; refuse it.
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError("must be an int", field=field, expected="int", actual=type(value).__name__)
    if not lo <= value <= _I32_MAX:
        raise PlanError("out of range", field=field, expected=f"[{lo}, {_I32_MAX}]", actual=value)


def check_token_op(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor | None
) -> int:
    """Arguments of the per-token ops: ``out [max_tokens]``, ``qo_indptr [reqs + 1]``,
    ``seq_lens [reqs]`` (when the op reads it). Returns ``reqs``."""
    _check_i32("out", out, 1)
    reqs = _check_indptr("qo_indptr", qo_indptr)
    _check_device(out, qo_indptr=qo_indptr)
    if seq_lens is not None:
        _check_i32("seq_lens", seq_lens, 1)
        _check_length("seq_lens", seq_lens, reqs, "len(qo_indptr) - 1")
        _check_device(out, seq_lens=seq_lens)
    return reqs


def check_token_request(out: torch.Tensor, qo_indptr: torch.Tensor, pad: int) -> int:
    reqs = check_token_op(out, qo_indptr, None)
    _check_scalar("pad", pad, 0)
    return reqs


def check_token_topk_lengths(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor, topk: int
) -> int:
    reqs = check_token_op(out, qo_indptr, seq_lens)
    _check_scalar("topk", topk, 1)
    return reqs


def check_token_kv_ranges(
    out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor
) -> int:
    _check_i32("out", out, 2)
    if out.shape[0] != 2:
        raise PlanError(
            "holds the rows ks and ke",
            field="out",
            expected="[2, max_tokens]",
            actual=tuple(out.shape),
        )
    reqs = _check_indptr("qo_indptr", qo_indptr)
    _check_i32("kv_indptr", kv_indptr, 1)
    _check_length("kv_indptr", kv_indptr, reqs + 1, "len(qo_indptr)")
    _check_device(out, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    return reqs


def check_kv_gather_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> int:
    _check_i32("out", out, 1)
    _check_i32("req_to_token", req_to_token, 2)
    _check_i32("req_pool_indices", req_pool_indices, 1, (torch.int32, torch.int64))
    reqs = _check_indptr("kv_indptr", kv_indptr)
    _check_length("req_pool_indices", req_pool_indices, reqs, "len(kv_indptr) - 1")
    _check_device(
        out, req_to_token=req_to_token, req_pool_indices=req_pool_indices, kv_indptr=kv_indptr
    )
    return reqs


def _token_owner(n: int, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t, b, real)`` for ``t in [0, n)``: the request owning ``t`` (clamped into
    ``[0, reqs)``, so gathers stay in bounds even for padding) and whether ``t`` is real.

    ``b`` = how many of ``indptr[1:]`` are ``<= t``: the last request starting at or before
    ``t``, which skips empty requests. Callers handle ``reqs == 0``."""
    reqs = indptr.shape[0] - 1
    t = torch.arange(n, dtype=I32, device=indptr.device)
    b = torch.searchsorted(indptr[1:], t, right=True, out_int32=True).clamp_(max=reqs - 1)
    return t, b, t < indptr[reqs:]


def _positions(out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor):
    """``(position, real)`` per token: ``seq_lens[b] - (qo_indptr[b + 1] - t)`` is the prefix
    length plus ``t``'s offset in its request (int32, wrapping like the kernels)."""
    t, b, real = _token_owner(out.shape[0], qo_indptr)
    ends = torch.index_select(qo_indptr, 0, b + 1)
    return torch.index_select(seq_lens, 0, b) - ends + t, real


def token_request(out: torch.Tensor, qo_indptr: torch.Tensor, pad: int) -> None:
    """The request each query token belongs to (gathers per-request data per token).
    Padding tokens get ``pad`` (e.g. a padding request's index): a caller-chosen valid
    index, never -1, since a negative index silently wraps around in a gather."""
    if check_token_request(out, qo_indptr, pad) == 0:
        out.fill_(pad)
        return
    _, b, real = _token_owner(out.shape[0], qo_indptr)
    out.copy_(torch.where(real, b, pad))


def token_positions(out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Rope positions of the new tokens: they continue after the cached prefix.
    Padding tokens get 0, a position every model accepts."""
    if check_token_op(out, qo_indptr, seq_lens) == 0:
        out.zero_()
        return
    pos, real = _positions(out, qo_indptr, seq_lens)
    out.copy_(torch.where(real, pos, 0))


def token_causal_lengths(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Token ``t`` attends to the KV up to and including itself: ``position + 1``.
    Padding tokens get 1, never 0: zero lengths make attention kernels and the deep_gemm
    scheduler read out of bounds."""
    if check_token_op(out, qo_indptr, seq_lens) == 0:
        out.fill_(1)
        return
    pos, real = _positions(out, qo_indptr, seq_lens)
    out.copy_(torch.where(real, pos + 1, 1))


def token_topk_lengths(
    out: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor, topk: int
) -> None:
    """How many KV tokens sparse attention reads per token: ``min(position + 1, topk)``;
    padding 1. (The same as ``clamp(token_causal_lengths, hi=topk)`` in one launch, without
    a ``[max_tokens]`` intermediate.)"""
    if check_token_topk_lengths(out, qo_indptr, seq_lens, topk) == 0:
        out.fill_(1)
        return
    pos, real = _positions(out, qo_indptr, seq_lens)
    out.copy_(torch.where(real, (pos + 1).clamp_(max=topk), 1))


def token_kv_ranges(out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor) -> None:
    """deep_gemm ``fp8_mqa_logits``'s ``ks``/``ke`` over the flat gathered KV: token ``t`` of
    request ``b`` reads ``[kv_indptr[b], kv_indptr[b] + position + 1)``, i.e. ``ke =
    kv_indptr[b + 1] - (qo_indptr[b + 1] - t) + 1``. Padding tokens read ``[0, 1)``: one
    real KV entry (the gathered KV always has one), never an empty or negative range.

    One op with ``out = [2, max_tokens]`` (row 0 ``ks``, row 1 ``ke``) rather than two:
    both come from the same search for the owning request, so one launch does both, and
    the rows ``out[0]`` / ``out[1]`` are the contiguous int32 ``[max_tokens]`` tensors the
    kernel takes, with no copy."""
    reqs = check_token_kv_ranges(out, qo_indptr, kv_indptr)
    if reqs == 0:
        out[0].zero_()
        out[1].fill_(1)
        return
    t, b, real = _token_owner(out.shape[1], qo_indptr)
    starts = torch.index_select(kv_indptr, 0, b)
    ends = torch.index_select(kv_indptr, 0, b + 1) - torch.index_select(qo_indptr, 0, b + 1)
    out[0].copy_(torch.where(real, starts, 0))
    out[1].copy_(torch.where(real, ends + t + 1, 1))


def kv_gather_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """The slot list of the flat gathered KV: ``out[kv_indptr[b] + j] =
    req_to_token[req_pool_indices[b], j]`` for ``j < seq_lens[b]``. Entries past
    ``kv_indptr[reqs]`` (the static capacity's tail) get slot 0, the null slot, so a gather
    through them reads a valid, harmless entry. Like ``gather_token_slots``, columns at or
    past ``req_to_token``'s width are never read (they give 0); the caller guarantees
    ``seq_lens <= ctx`` and that the offsets fit ``out``."""
    reqs = check_kv_gather_slots(out, req_to_token, req_pool_indices, kv_indptr)
    ctx = req_to_token.shape[1]
    if reqs == 0 or ctx == 0:
        out.zero_()
        return
    p, b, real = _token_owner(out.shape[0], kv_indptr)
    j = p - torch.index_select(kv_indptr, 0, b)
    take = real & (j >= 0) & (j < ctx)
    rows = torch.index_select(req_pool_indices, 0, b).long()
    slots = req_to_token[rows, j.clamp(0, ctx - 1).long()]
    out.copy_(torch.where(take, slots, 0))


def check_last_token_rows(out: torch.Tensor, qo_indptr: torch.Tensor) -> int:
    """``out`` is ``[reqs]`` or ``[reqs, n]`` (the last ``n`` rows of each request)."""
    _check_i32("out", out, 2 if isinstance(out, torch.Tensor) and out.dim() == 2 else 1)
    reqs = _check_indptr("qo_indptr", qo_indptr)
    _check_length("out", out, reqs, "len(qo_indptr) - 1")
    _check_device(out, qo_indptr=qo_indptr)
    return reqs


def last_token_rows(out: torch.Tensor, qo_indptr: torch.Tensor) -> None:
    """The rows of each request's last ``n`` query tokens, whose logits the LM head computes
    (it runs on these rows only): ``out[b, i] = min(max(end - n + i, start), end - 1)`` with
    ``start, end = qo_indptr[b], qo_indptr[b + 1]``, for ``out`` of ``[reqs, n]``; ``[reqs]``
    is ``n = 1``, ``out[b] = end - 1``, the row whose logits predict the request's next token.

    Why ``n`` rows: a mixed batch of verify rows (a request's last token and ``n - 1`` drafts)
    and prompt chunks reads every verify row, and one rule for all requests keeps the output
    ``[reqs, n]`` whatever the mix. A request of fewer than ``n`` tokens repeats its first
    row; a padding request (``start == end``) gives the last real token's row, ``end - 1``,
    in every column, as with ``n = 1``."""
    check_last_token_rows(out, qo_indptr)
    n = out.shape[1] if out.dim() == 2 else 1
    start, end = qo_indptr[:-1].unsqueeze(1), qo_indptr[1:].unsqueeze(1)
    offsets = torch.arange(n, 0, -1, dtype=I32, device=out.device)  # n - i
    rows = torch.minimum(torch.maximum(end - offsets, start), end - 1)
    out.copy_(rows.view(out.shape))


def check_slot_pages(out: torch.Tensor, out_cache_loc: torch.Tensor, page_size: int) -> int:
    _check_i32("out", out, 2)
    if out.shape[0] != 2:
        raise PlanError("must be [2, tokens]", field="out", expected=2, actual=_shape(out))
    _check_i32("out_cache_loc", out_cache_loc, 1)
    _check_length("out_cache_loc", out_cache_loc, out.shape[1], "out.shape[1]")
    _check_device(out, out_cache_loc=out_cache_loc)
    _check_scalar("page_size", page_size, 1)
    return out.shape[1]


def slot_pages(out: torch.Tensor, out_cache_loc: torch.Tensor, page_size: int) -> None:
    """``out[0] = loc // page_size``, ``out[1] = loc % page_size``: the page and the offset in
    it each new token's KV is written to (paged caches such as deep_gemm's index cache are
    addressed this way); padding tokens write slot 0, so (0, 0)."""
    check_slot_pages(out, out_cache_loc, page_size)
    torch.div(out_cache_loc, page_size, rounding_mode="floor", out=out[0])
    torch.remainder(out_cache_loc, page_size, out=out[1])
