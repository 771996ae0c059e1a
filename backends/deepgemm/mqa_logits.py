"""deep_gemm's ``fp8_mqa_logits`` (the ragged prefill indexer) and a precise reference.

For query row ``r`` (one token of an extend / prefill batch) and KV token ``t`` of a flat,
gathered KV::

    logits[r, t] = k_scale[t] * sum_h weights[r, h] * relu(q[r, h, :] . k[t, :])

for ``ks[r] <= t < ke[r]``: each row reads the half-open KV range ``[ks[r], ke[r])``.

What the 0.1.0 kernel does (``csrc/apis/attention.hpp`` and
``deep_gemm/include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh`` of sgl-project/DeepGEMM
v0.1.0, identical to the headers the wheel ships):

* the result is ``torch.empty``: row stride ``align(kv_tokens + 256, 8)`` sliced to
  ``[tokens, kv_tokens]``; with ``max_seqlen_k > 0`` (the compressed layout, row ``r``
  holding KV ``ks[r] ..`` from column 0) row stride ``align(max_seqlen_k, 256)`` sliced to
  ``[tokens, max_seqlen_k]``;
* uncompressed, a block of ``128 // H`` rows writes real scores over the union of its
  rows' ranges (start rounded down to 4, then whole 256-token blocks), so entries outside
  a row's own range hold either uninitialised memory or scores the row must not see;
  ``clean_logits=True`` overwrites every column outside ``[ks, ke)`` with ``-inf``;
* compressed, only ``t in [ks, ke)`` is written (column ``t - ks``); columns past
  ``ke - ks`` are uninitialised, and ``clean_logits=True`` is REJECTED (host assert), so
  :func:`validate_mqa_logits_inputs` refuses it too. A row wider than ``max_seqlen_k``
  would write into the next row: refused when values are checked;
* ``ks``/``ke`` are read as ``uint32`` and ``weights`` through a TMA descriptor whose row
  stride is ``H`` whatever its real stride (the host only checks ``stride(1) == 1``), so a
  strided ``weights`` would be read wrong silently: it must be contiguous here.

``fp8_fp4_mqa_logits`` is the same kernel with ``q`` as a pair ``(q, q_sf)`` (``q_sf``
None for fp8, int32 UE8M0 scales for packed fp4, SM100 only), the range arguments named
``cu_seq_len_k_start``/``cu_seq_len_k_end`` and a ``logits_dtype``: bfloat16 logits are
the fp32 value rounded once at the store (``static_cast`` to ``bfloat16_t``, nearest even),
in a result of the same shape and the same row stride in ELEMENTS (0.1.0 does not widen
the alignment for 2-byte elements). ``clean_logits`` writes bf16 ``-inf``.

The reference writes ``-inf`` at every position outside the row's range in BOTH modes and
whatever ``clean_logits`` says, so code that forgets to mask fails on the CPU. It returns
the kernel's strided view, so code that assumes a contiguous result fails there too.
Dot products are exact: every e4m3 value is an integer multiple of ``2**-9`` below
``2**18`` such units, so every partial sum of a dot over ``D`` elements is a multiple of
``2**-18`` below ``D * 2**36`` units, exactly representable in float64 for any ``D`` up to
``2**16``. Heads are accumulated in float64 in head order and the result is rounded to
float32 once. So the value does not depend on chunking, layout or device: the compressed
layout is the uncompressed one shifted, bit for bit, and a GPU comparison measures only
the kernel's own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from planner.errors import PlanError
from planner.ops import capture_guarded

from . import _native
from .scores import parse_logits_dtype, refuse_fp4, split_scaled_q, weighted_head_sum

__all__ = [
    "validate_mqa_logits_inputs",
    "mqa_logits_row_stride",
    "reference_fp8_mqa_logits",
    "fp8_mqa_logits",
    "fp8_fp4_mqa_logits",
]

_BLOCK_KV = 256  # the kernel's KV block: output strides are derived from it
_STRIDE_ALIGN = 8  # uncompressed row stride alignment (fp32 elements, 32 bytes)
_I32_MAX = 2**31 - 1
# float64 elements per chunk of the reference (dots [T, H, C], gathered keys [T, C, D]).
_CHUNK_ELEMENTS = 2**25
E4M3 = torch.float8_e4m3fn


def _fail(field: str, message: str, expected: object, actual: object) -> PlanError:
    return PlanError(message, field=field, expected=expected, actual=actual)


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)}"


def _check_tensor(
    field: str, t: object, dtype: torch.dtype, shape: Sequence[int | None], what: str
) -> torch.Tensor:
    """dtype, rank, sizes (``None`` = any) and contiguity, in that order of blame."""
    ok = (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.dim() == len(shape)
        and all(want is None or got == want for got, want in zip(t.shape, shape))
    )
    if not ok:
        raise _fail(field, f"must be {what}", f"{dtype} {list(shape)}", _describe(t))
    if not t.is_contiguous():
        raise _fail(field, "must be contiguous", "contiguous", tuple(t.stride()))
    return t


def mqa_logits_row_stride(kv_tokens: int, max_seqlen_k: int = 0) -> int:
    """Row stride (fp32 elements) of the kernel's result, which the reference reproduces."""
    if max_seqlen_k > 0:
        return -(-max_seqlen_k // _BLOCK_KV) * _BLOCK_KV
    return -(-(kv_tokens + _BLOCK_KV) // _STRIDE_ALIGN) * _STRIDE_ALIGN


def _check_ranges(ks: torch.Tensor, ke: torch.Tensor, kv_tokens: int, max_seqlen_k: int) -> None:
    """The data-reading checks; each names the first offending row."""
    if ks.numel() == 0:
        return
    start, end = ks.to(torch.int64), ke.to(torch.int64)

    def first(bad: torch.Tensor) -> int:
        return int(bad.nonzero()[0, 0])

    if bool((start < 0).any()):
        r = first(start < 0)
        raise _fail("ks", "KV ranges start at 0 or later", ">= 0", f"row {r}: ks={int(start[r])}")
    if bool((start > end).any()):
        r = first(start > end)
        raise _fail(
            "ks",
            "a range must not end before it starts",
            "ks <= ke",
            f"row {r}: {int(start[r])} > {int(end[r])}",
        )
    if bool((end > kv_tokens).any()):
        r = first(end > kv_tokens)
        raise _fail(
            "ke",
            "ranges must end within the KV",
            f"<= kv_tokens = {kv_tokens}",
            f"row {r}: {int(end[r])}",
        )
    if max_seqlen_k > 0 and bool((end - start > max_seqlen_k).any()):
        r = first(end - start > max_seqlen_k)
        raise _fail(
            "max_seqlen_k",
            "the compressed layout needs every range to fit in a row",
            f">= ke - ks = {int(end[r] - start[r])} (row {r})",
            max_seqlen_k,
        )


def validate_mqa_logits_inputs(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean_logits: bool = False,
    max_seqlen_k: int = 0,
    *,
    check_values: bool = False,
) -> tuple[int, int, int, int]:
    """What deep_gemm 0.1.0 accepts (host side); returns ``(tokens, kv_tokens, H, D)``.

    Head count and head dim are not limited here (the kernel wants H 32 or 64, D 32, 64 or
    128, and checks that itself), so the reference also serves small test models.
    ``check_values`` reads ``ks``/``ke``: ``0 <= ks <= ke <= kv_tokens`` and, compressed,
    ``ke - ks <= max_seqlen_k``. Reading CUDA values syncs the host, hence opt-in.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != E4M3 or q.dim() != 3:
        raise _fail("q", "must be float8_e4m3fn [tokens, H, D]", "e4m3 3-D", _describe(q))
    if not q.is_contiguous():
        raise _fail("q", "must be contiguous", "contiguous", tuple(q.stride()))
    tokens, heads, dim = q.shape
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise _fail("kv", "must be the pair (k, k_scale)", "(k, k_scale)", type(kv).__name__)
    k, k_scale = kv
    _check_tensor("k", k, E4M3, (None, dim), "float8_e4m3fn [kv_tokens, D] with q's D")
    kv_tokens = k.shape[0]
    _check_tensor("k_scale", k_scale, torch.float32, (kv_tokens,), "float32 [kv_tokens]")
    _check_tensor("weights", weights, torch.float32, (tokens, heads), "float32 [tokens, H]")
    _check_tensor("ks", ks, torch.int32, (tokens,), "int32 [tokens]")
    _check_tensor("ke", ke, torch.int32, (tokens,), "int32 [tokens]")
    if not isinstance(clean_logits, bool):
        raise _fail("clean_logits", "must be a bool", "bool", type(clean_logits).__name__)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
        raise _fail("max_seqlen_k", "must be an int", "int", type(max_seqlen_k).__name__)
    if not 0 <= max_seqlen_k <= _I32_MAX:
        raise _fail(
            "max_seqlen_k", "must lie in int32 and be >= 0", f"[0, {_I32_MAX}]", max_seqlen_k
        )
    if max_seqlen_k > 0 and clean_logits:
        raise _fail(
            "clean_logits",
            "deep_gemm 0.1.0 rejects clean_logits with the compressed layout (max_seqlen_k > 0); "
            "mask columns >= ke - ks yourself",
            False,
            clean_logits,
        )
    devices = {t.device for t in (q, k, k_scale, weights, ks, ke)}
    if len(devices) != 1:
        raise _fail(
            "q", "all tensors must be on one device", "one device", sorted(map(str, devices))
        )
    if check_values:
        _check_ranges(ks, ke, kv_tokens, max_seqlen_k)
    return tokens, kv_tokens, heads, dim


def reference_fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean_logits: bool = False,
    max_seqlen_k: int = 0,
    *,
    logits_dtype: torch.dtype = torch.float32,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Precise PyTorch version of ``deep_gemm.fp8_mqa_logits`` (CPU or CUDA).

    ``logits_dtype=torch.bfloat16`` rounds the fp32 result once to bf16 (as the kernel's
    store does), same shape and row stride.
    Returns float32 ``[tokens, kv_tokens]`` (or ``[tokens, max_seqlen_k]`` compressed) as
    the kernel's strided view. Unlike the kernel it writes ``-inf`` at EVERY position
    outside a row's range, with or without ``clean_logits``: uncompressed, columns outside
    ``[ks, ke)``; compressed, columns at or past ``ke - ks``. No host syncs (graph-safe);
    ``check_values`` (default: only for CPU tensors outside an emulated capture) runs the
    data-reading range checks.
    Unchecked out-of-range values stay defined: KV indices are clamped, then masked.
    Works in chunks of KV columns to bound memory.
    """
    if check_values is None:
        # Off CUDA only, and not under an emulated capture: it reads the ranges on the host.
        check_values = not q.is_cuda and not capture_guarded()
    tokens, kv_tokens, heads, dim = validate_mqa_logits_inputs(
        q, kv, weights, ks, ke, clean_logits, max_seqlen_k, check_values=check_values
    )
    out_dtype = parse_logits_dtype(logits_dtype)
    k, k_scale = kv
    compressed = max_seqlen_k > 0
    width = max_seqlen_k if compressed else kv_tokens
    stride = mqa_logits_row_stride(kv_tokens, max_seqlen_k)
    full = torch.full((tokens, stride), float("-inf"), dtype=out_dtype, device=q.device)
    out = full[:, :width]
    if tokens == 0 or width == 0 or kv_tokens == 0 or heads == 0:
        return out

    q64 = q.double()
    w64 = weights.double()
    start = ks.to(torch.int64).unsqueeze(1)
    end = ke.to(torch.int64).unsqueeze(1)
    k_bytes = k.view(torch.uint8)  # fp8 gathers are not implemented everywhere
    chunk = max(1, _CHUNK_ELEMENTS // (tokens * max(heads, dim)))
    for c0 in range(0, width, chunk):
        c1 = min(c0 + chunk, width)
        cols = torch.arange(c0, c1, device=q.device)
        if compressed:
            t = start + cols  # [T, C]: the KV token column c of row r holds
            idx = t.clamp(0, kv_tokens - 1)
            keys = k_bytes[idx].view(E4M3).double()  # [T, C, D]
            dots = torch.bmm(q64, keys.transpose(1, 2))  # [T, H, C]
            scale = k_scale[idx].double()
            valid = (t < end) & (t < kv_tokens)
        else:
            keys = k[c0:c1].double()  # [C, D]
            dots = (q64.view(tokens * heads, dim) @ keys.T).view(tokens, heads, c1 - c0)
            scale = k_scale[c0:c1].double().unsqueeze(0)
            valid = (cols >= start) & (cols < end)
        score = (weighted_head_sum(dots, w64) * scale).float()
        out[:, c0:c1] = torch.where(valid, score, float("-inf")).to(out_dtype)
    return out


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean_logits: bool = False,
    max_seqlen_k: int = 0,
    *,
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.fp8_mqa_logits`` (fp32 ``[tokens, kv_tokens or max_seqlen_k]``).

    ``backend="auto"``: the real kernel for CUDA tensors when deep_gemm imports, else the
    reference. Entries outside each row's range are undefined on the real kernel unless
    ``clean_logits`` (``-inf`` in the reference): mask them, or ask for clean logits.
    Inputs are shape-checked on every path; range values only on CPU (reading them on
    CUDA would sync the host once per layer).
    """
    dg = _native.kernel_module(backend, q)
    if dg is not None:
        validate_mqa_logits_inputs(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)
        return dg.fp8_mqa_logits(q, tuple(kv), weights, ks, ke, clean_logits, max_seqlen_k)
    return reference_fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = False,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float,
    *,
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.fp8_fp4_mqa_logits``: ``q`` is the pair ``(q, q_sf)``.

    ``(q, None)`` with fp8 ``q`` is :func:`fp8_mqa_logits` (``ks``/``ke`` are
    ``cu_seq_len_k_start``/``cu_seq_len_k_end``) with a choice of ``logits_dtype``
    (float32 or bfloat16). fp4 ``q`` (``q_sf`` given) runs on deep_gemm only (CUDA tensors;
    0.1.0 itself wants SM100); the reference refuses it naming ``q``.
    """
    q_fp, q_sf = split_scaled_q(q)
    out_dtype = parse_logits_dtype(logits_dtype)
    ranges = (cu_seq_len_k_start, cu_seq_len_k_end)
    if q_sf is not None:
        dg = _native.kernel_module(backend, q_fp) if isinstance(q_fp, torch.Tensor) else None
        if dg is None:
            raise refuse_fp4("q")
        return dg.fp8_fp4_mqa_logits(
            (q_fp, q_sf), kv, weights, *ranges, clean_logits, max_seqlen_k, out_dtype
        )
    if not isinstance(q_fp, torch.Tensor):
        raise _fail("q", "q[0] must be a tensor", "torch.Tensor", _describe(q_fp))
    dg = _native.kernel_module(backend, q_fp)
    if dg is not None:
        validate_mqa_logits_inputs(q_fp, kv, weights, *ranges, clean_logits, max_seqlen_k)
        return dg.fp8_fp4_mqa_logits(
            (q_fp, None), tuple(kv), weights, *ranges, clean_logits, max_seqlen_k, out_dtype
        )
    return reference_fp8_mqa_logits(
        q_fp, kv, weights, *ranges, clean_logits, max_seqlen_k, logits_dtype=out_dtype
    )
