"""deep_gemm's ``fp8_paged_mqa_logits`` (the DeepSeek-V3.2 indexer scores) and a reference.

For query row ``r = b * next_n + i`` (request ``b``, MTP token ``i``) and KV position ``t``::

    logits[r, t] = k_scale[t] * sum_h weights[r, h] * relu(q[b, i, h, :] . k[t, :])

with ``k``/``k_scale`` read from the paged index cache through ``block_table[b]``, all in
fp32 (the fp8 products are accumulated by WGMMA in fp32 on the GPU).

What the 0.1.0 kernel writes (``deep_gemm/include/deep_gemm/impls/
sm90_fp8_paged_mqa_logits.cuh``): for each request it covers the 64-token blocks up to
``ceil(context_lens[b, next_n - 1] / 64)`` -- the LAST column -- for every one of the
request's ``next_n`` rows, and nothing else. The output is ``torch.empty`` of width
``align(max_context_len, 256)`` sliced to ``max_context_len``, so entries at or past a row's
own length are either uninitialised memory or (for row 0 of an MTP pair) real scores of
tokens that row must not see; ``clean_logits=True`` would mask them but 0.1.0 rejects it
with 2-D lengths. Row ``i`` of request ``b`` may attend to positions
``< context_lens[b, i]`` (per-token causal lengths): callers MUST mask the rest.

``logits_dtype=torch.bfloat16`` (``fp8_fp4_paged_mqa_logits``) makes the kernel round its
fp32 value once to bf16 at the store; the reference rounds its fp32 result the same way.
``indices=`` (varlen, ``next_n == 1``, SM100 only in 0.1.0): row ``t`` is one token with
its own length ``context_lens[t, 0]``; a token paired with the next one (same
``indices``, see :mod:`.schedule`) is computed over the pair's length through the block-table
row of the pair's FIRST token, which the reference reproduces. Values below each token's
length do not depend on the pairing otherwise.

The reference writes ``-inf`` at every position ``>= context_lens[b, i]`` so that
forgetting to mask shows up on CPU, and otherwise computes the formula above exactly in
fp32. It returns the same strided view (row stride ``align(max_context_len, 256)``) as the
kernel, so code that wrongly assumes a contiguous result fails on CPU too.
"""

from __future__ import annotations

from typing import Literal

import torch

from planner.errors import PlanError

from . import _native
from .fp8 import PAGE, _check_cache, index_cache_views
from .schedule import SPLIT_KV, validate_context_lens, validate_indices, varlen_block_rows
from .scores import parse_logits_dtype, refuse_fp4, split_scaled_q, weighted_head_sum

__all__ = [
    "validate_paged_logits_inputs",
    "reference_fp8_paged_mqa_logits",
    "fp8_paged_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
]

_CHUNK_TOKENS = 4096


def _fail(field: str, message: str, expected: object, actual: object) -> PlanError:
    return PlanError(message, field=field, expected=expected, actual=actual)


def validate_paged_logits_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    indices: torch.Tensor | None = None,
    check_values: bool = False,
) -> tuple[int, int, int, int]:
    """Shape/dtype checks of deep_gemm 0.1.0 (host side); returns ``(B, next_n, H, D)``.

    The head count is not limited here (the real kernel wants 32 or 64 and checks that
    itself). ``check_values`` also runs the data-reading length checks of
    :func:`validate_context_lens`.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.dim() != 4:
        raise _fail(
            "q",
            "must be float8_e4m3fn [B, next_n, H, D]",
            "e4m3 4-D",
            f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}",
        )
    if not q.is_contiguous():
        raise _fail("q", "must be contiguous", "contiguous", tuple(q.stride()))
    batch, next_n, heads, dim = q.shape
    if next_n not in (1, 2):
        raise _fail("q", "next_n must be 1 or 2", (1, 2), next_n)
    cache_dim = _check_cache(kv_cache)
    if cache_dim != dim:
        raise _fail("kv_cache", "head dim differs from q", dim + 4, cache_dim + 4)
    if (
        weights.dtype != torch.float32
        or tuple(weights.shape) != (batch * next_n, heads)
        or not weights.is_contiguous()
    ):
        raise _fail(
            "weights",
            "must be contiguous float32 [B * next_n, H]",
            f"float32 {(batch * next_n, heads)}",
            f"{weights.dtype} {tuple(weights.shape)}",
        )
    validate_context_lens(context_lens, check_values=check_values)
    if tuple(context_lens.shape) != (batch, next_n):
        raise _fail(
            "context_lens",
            "must be [B, next_n] like q",
            (batch, next_n),
            tuple(context_lens.shape),
        )
    if (
        block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] != batch
        or block_table.stride(1) != 1
    ):
        raise _fail(
            "block_table",
            "must be int32 [B, max_blocks] with unit column stride",
            f"int32 [{batch}, n]",
            f"{block_table.dtype} {tuple(block_table.shape)}",
        )
    if (
        schedule_meta.dtype != torch.int32
        or schedule_meta.dim() != 2
        or schedule_meta.shape[1] != 2
        or schedule_meta.shape[0] < 2
        or not schedule_meta.is_contiguous()
    ):
        raise _fail(
            "schedule_meta",
            "must be contiguous int32 [num_sms + 1, 2]",
            "int32 [S + 1, 2]",
            f"{schedule_meta.dtype} {tuple(schedule_meta.shape)}",
        )
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int):
        raise _fail("max_context_len", "must be an int", "int", type(max_context_len).__name__)
    if max_context_len < 0:
        raise _fail("max_context_len", "must be >= 0", ">= 0", max_context_len)
    if clean_logits:
        raise _fail(
            "clean_logits",
            "deep_gemm 0.1.0 rejects clean_logits with 2-D context_lens; "
            "mask positions >= context_lens yourself",
            False,
            clean_logits,
        )
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table, schedule_meta)}
    if len(devices) != 1:
        raise _fail(
            "q", "all tensors must be on one device", "one device", sorted(map(str, devices))
        )
    if indices is not None:
        validate_indices(indices, context_lens, check_values=check_values)
    return batch, next_n, heads, dim


def reference_fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    indices: torch.Tensor | None = None,
    logits_dtype: torch.dtype = torch.float32,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Exact fp32 PyTorch version of ``deep_gemm.fp8_paged_mqa_logits`` (CPU or CUDA).

    Returns ``[B * next_n, max_context_len]`` float32 (a strided view, like the kernel),
    ``-inf`` at positions ``>= context_lens[b, i]``. ``logits_dtype=torch.bfloat16``
    rounds the same fp32 values to bf16 (to nearest even, as the kernel's store does);
    ``indices`` is 0.1.0's varlen mode (module doc). ``schedule_meta`` is validated but not
    needed: the reference computes every block. No host syncs, so it is graph-capturable;
    ``check_values`` (default: only for CPU tensors) runs the data-reading length checks.
    Block-table entries past a row's length may hold anything (they are clamped, then
    masked). Works in chunks of 4096 tokens to bound memory.
    """
    if check_values is None:
        check_values = not q.is_cuda
    batch, next_n, heads, dim = validate_paged_logits_inputs(
        q,
        kv_cache,
        weights,
        context_lens,
        block_table,
        schedule_meta,
        max_context_len,
        clean_logits,
        indices=indices,
        check_values=check_values,
    )
    out_dtype = parse_logits_dtype(logits_dtype)
    width = max_context_len
    stride = -(-width // SPLIT_KV) * SPLIT_KV
    full = torch.full((batch * next_n, stride), float("-inf"), dtype=out_dtype, device=q.device)
    out = full[:, :width]
    if width == 0:
        return out

    k_view, s_view = index_cache_views(kv_cache)
    num_blocks = k_view.shape[0]
    need_blocks = -(-width // PAGE)
    if indices is not None:  # both tokens of a pair read the first token's row
        block_table = block_table[varlen_block_rows(indices)]
    table = block_table[:, :need_blocks].to(torch.int64)
    if table.shape[1] < need_blocks:
        table = torch.nn.functional.pad(table, (0, need_blocks - table.shape[1]))
    table = table.clamp(0, num_blocks - 1)

    q64 = q.double()  # [B, n, H, D]; fp8 products are exact in float64 (see .scores)
    w64 = weights.double()  # [B * n, H]
    lens = context_lens.to(torch.int64).unsqueeze(-1)  # [B, n, 1]
    out3 = full.view(batch, next_n, stride)  # row b * next_n + i == [b, i]
    chunk_blocks = max(1, _CHUNK_TOKENS // PAGE)
    for b0 in range(0, need_blocks, chunk_blocks):
        ids = table[:, b0 : b0 + chunk_blocks]  # [B, cb]
        tokens = ids.shape[1] * PAGE
        k = k_view.view(torch.uint8)[ids].view(torch.float8_e4m3fn).double()
        k = k.reshape(batch, tokens, dim)
        k_scale = s_view[ids].reshape(batch, 1, tokens).double()
        dots = torch.einsum("bnhd,btd->bnht", q64, k).reshape(batch * next_n, heads, tokens)
        score = weighted_head_sum(dots, w64).view(batch, next_n, tokens) * k_scale
        score = score.float()  # [B, n, T]
        t0 = b0 * PAGE
        pos = torch.arange(t0, t0 + tokens, device=q.device)
        score = torch.where(pos < lens, score, float("-inf"))
        t1 = min(t0 + tokens, width)
        out3[:, :, t0:t1] = score[:, :, : t1 - t0].to(out_dtype)
    return out


def _paged_kernel(backend: object, q: torch.Tensor, indices: torch.Tensor | None):
    """The deep_gemm module to run on, or None for the reference: varlen (``indices``) runs
    on deep_gemm only where 0.1.0 does, SM100; elsewhere ``"auto"`` takes the reference."""
    dg = _native.kernel_module(backend, q)
    if dg is not None and indices is not None and _native.arch_major(q) != 10:
        if backend == "native":
            raise _fail(
                "indices",
                "deep_gemm 0.1.0 computes varlen logits on SM100 only",
                "compute capability 10.x, or backend 'auto'/'reference'",
                f"compute capability {_native.arch_major(q)}.x",
            )
        return None
    return dg


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    indices: torch.Tensor | None = None,
    *,
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.fp8_paged_mqa_logits`` (fp32 ``[B * next_n, max_context_len]``).

    ``backend="auto"``: the real kernel for CUDA tensors when deep_gemm imports, else the
    reference (varlen ``indices``: the real kernel on SM100 only, as in 0.1.0). Entries at or
    past each row's length are undefined on the real kernel (``-inf`` in the reference):
    mask them. Inputs are shape-checked on every path; length values only on CPU (reading
    them on CUDA would sync the host once per layer).
    """
    args = (q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len)
    dg = _paged_kernel(backend, q, indices)
    if dg is not None:
        validate_paged_logits_inputs(*args, clean_logits, indices=indices)
        return dg.fp8_paged_mqa_logits(*args, clean_logits, indices)
    return reference_fp8_paged_mqa_logits(*args, clean_logits, indices=indices)


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    logits_dtype: torch.dtype = torch.float,
    indices: torch.Tensor | None = None,
    *,
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.fp8_fp4_paged_mqa_logits``: ``q`` is the pair ``(q, q_sf)``.

    ``(q, None)`` with fp8 ``q`` is :func:`fp8_paged_mqa_logits` with a choice of
    ``logits_dtype`` (float32 or bfloat16). fp4 ``q`` (``q_sf`` given) runs on deep_gemm
    only (CUDA tensors; 0.1.0 itself wants SM100); the reference refuses it naming ``q``.
    """
    q_fp, q_sf = split_scaled_q(q)
    out_dtype = parse_logits_dtype(logits_dtype)
    args = (kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len)
    if q_sf is not None:
        dg = _native.kernel_module(backend, q_fp) if isinstance(q_fp, torch.Tensor) else None
        if dg is None:
            raise refuse_fp4("q")
        return dg.fp8_fp4_paged_mqa_logits((q_fp, q_sf), *args, clean_logits, out_dtype, indices)
    if not isinstance(q_fp, torch.Tensor):
        raise _fail("q", "q[0] must be a tensor", "torch.Tensor", type(q_fp).__name__)
    dg = _paged_kernel(backend, q_fp, indices)
    if dg is not None:
        validate_paged_logits_inputs(q_fp, *args, clean_logits, indices=indices)
        return dg.fp8_fp4_paged_mqa_logits((q_fp, None), *args, clean_logits, out_dtype, indices)
    return reference_fp8_paged_mqa_logits(
        q_fp, *args, clean_logits, indices=indices, logits_dtype=out_dtype
    )
