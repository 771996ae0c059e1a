"""Triton grouped GEMM: ``out[m] = a[m] @ b[g(m)]`` over row groups given by cumulative ends.

The routed MoE's portable GPU path, for what ``torch._grouped_mm`` cannot take without a
host sync (fp32/fp16, GPUs other than sm90/sm100). One launch, static grid: the tile
count is bounded from shapes alone (``cdiv(rows, BM) + min(groups, rows)``: every group
wastes at most one partial tile), and each program finds its own group and first row
from the ``ends`` table in device memory, so nothing is read back on the host and the
launch can be captured in a CUDA graph. Programs past the real tile count exit after
the lookup without touching ``b``.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, _interpreting, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["INVARIANT_TILE_ROWS", "grouped_mm_triton", "tile_rows"]

INVARIANT_TILE_ROWS = 16
"""Rows per tile in the batch-invariant mode, whatever the batch: ``tile_rows`` picks 16 to
64 from the mean group size, and another tile shape may sum a row's products in another
order. 16 is what decode batches get anyway (groups of a few rows over 256 experts), so
decode costs the same; large prefill groups re-read their expert's weights more often."""


def _grouped_mm_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    ends_ptr,
    n_groups,
    n,
    k,
    sa_m,
    sa_k,
    sb_g,
    sb_k,
    sb_n,
    so_m,
    so_n,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    G_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    # Which group owns this tile: groups take cdiv(rows, BM) tiles each, in order.
    g = tl.arange(0, G_BLOCK)
    in_g = g < n_groups
    end = tl.load(ends_ptr + g, mask=in_g, other=0)
    start = tl.load(ends_ptr + g - 1, mask=in_g & (g > 0), other=0)
    tiles = tl.where(in_g, (end - start + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_end <= tile).to(tl.int32), axis=0)  # n_groups or more: no work
    mine = g == group
    row0 = tl.sum(tl.where(mine, start, 0), axis=0)
    row0 += (tile - tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)) * BM
    row_end = tl.sum(tl.where(mine, end, 0), axis=0)  # 0 when the tile has no group
    k_stop = tl.where(row0 < row_end, k, 0)
    b_group = b_ptr + tl.minimum(group, n_groups - 1).to(tl.int64) * sb_g

    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < n
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * sa_m
    b_cols = b_group + cols.to(tl.int64)[None, :] * sb_n
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_stop, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < k
        a = tl.load(a_rows + ks[None, :] * sa_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * sb_k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # interpreter only (see the launcher); exact products of 16-bit values
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_grouped_mm = LazyKernel(_grouped_mm_kernel, only=(["n_groups"], ["ends_ptr"]))
"""Specialised on the model's sizes and strides (fixed for a run; their divisibility by 16
turns loads into wide vector loads), not on the group count and ends, which change with
every batch's routing: specialising on them compiled a new variant in the first prefill of
a run (0.38 s on the H200)."""


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile from shapes only: near the mean group size, 16 (decode) to 64."""
    mean = -(-rows // max(groups, 1))
    return min(64, max(16, triton.next_power_of_2(mean)))


def grouped_mm_triton(
    a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, *, block_rows: int | None = None
) -> torch.Tensor:
    """``a [M, K] @ b [G, K, N]`` by groups; group ``g`` owns rows ``[ends[g-1], ends[g])``.

    ``block_rows`` fixes the rows per tile (a power of two, at least 16; the batch-invariant
    mode's ``INVARIANT_TILE_ROWS``); by default it follows the mean group size.

    ``ends`` int32 ``[G]``, non-decreasing, ``ends[-1] <= M`` (rows past it come back
    unspecified). ``b`` may be any strided view (e.g. ``w.transpose(1, 2)`` of stacked
    ``nn.Linear`` weights). fp32 inputs multiply in IEEE fp32, 16-bit ones on tensor
    cores with fp32 accumulation; the output has ``a``'s dtype.
    """
    if not triton_available(a.device):
        raise RuntimeError(
            f"Triton cannot run on {a.device}: it needs CUDA, or CPU tensors with TRITON_INTERPRET=1"
        )
    m, k = a.shape
    groups, _, n = b.shape
    # The interpreter handles 16-bit values badly (its dot is wrong, its fp32 -> bf16 cast
    # truncates): there it multiplies in fp32 and torch rounds the fp32 result.
    emulate = _interpreting() and a.dtype != torch.float32
    out = torch.empty(m, n, dtype=torch.float32 if emulate else a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out.to(a.dtype)
    bm = tile_rows(m, groups) if block_rows is None else block_rows
    bn = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    bk = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, bm) + min(groups, m), triton.cdiv(n, bn))
    _grouped_mm[grid](
        out,
        a,
        b,
        ends,
        groups,
        n,
        k,
        *a.stride(),
        *b.stride(),
        *out.stride(),
        BM=bm,
        BN=bn,
        BK=bk,
        G_BLOCK=max(16, triton.next_power_of_2(groups)),
        IEEE=a.dtype == torch.float32,
        UPCAST=emulate,
        num_warps=4,
    )
    return out.to(a.dtype)
