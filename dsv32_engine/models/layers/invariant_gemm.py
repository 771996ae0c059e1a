"""A batch-invariant GEMM for the CUDA forward: a row's output bits never depend on the batch.

cuBLAS picks its algorithm (tile shape, split-K, the kernel itself) from the problem's
``M``: a decode row of 8 and the same row inside a verify of 32 are summed in different
orders and round differently. Tiny differences, but the indexer quantises to fp8 and keeps
a top-k, and greedy decoding keeps an argmax: one flipped rounding changes tokens, so
speculative greedy stops equalling plain greedy (issue 39).

Here one Triton kernel computes ``out[g] = a[g] @ b[g]`` (``g`` an optional batch over
weights, e.g. the MLA heads) with a FIXED tile configuration: ``BLOCK_M``, ``BLOCK_N``,
``BLOCK_K``, ``num_warps`` and ``num_stages`` come from the weight's ``N``, ``K``, group
count and dtypes only (``tile_config``), never from ``M``; no autotuning. A weight with
few column tiles (a decode GEMM that would leave most SMs idle) is cut along ``K`` into a
FIXED number of splits, also from ``N``, ``K`` and the group count only: each split walks
its ``K`` range in order into an fp32 partial, and a second kernel adds the partials in
split order, then the bias, and rounds once. Without splits, each output element is one
fp32 accumulator walked over ``K`` in ``BLOCK_K`` steps in order, rounded once. The rows
of a tile are independent lanes of the same instructions, so a row's result is the same bits wherever it sits in whichever batch
(``M`` is not specialised on either: one compiled kernel for every batch size).

16-bit operands multiply on tensor cores; fp32 ones (or a 16-bit activation against an
fp32 weight, the indexer's ``weights_proj``: widened in registers, exactly) in IEEE fp32.
The exact reference is the float64 product rounded once (``invariant_mm_reference``).

Off CUDA nothing routes here (the CPU model is already invariant through ``exact``'s
float64 contractions); under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors for the
tests, multiplying 16-bit values in fp32 (the interpreter's 16-bit dot is wrong) with
torch rounding the fp32 result, as ``grouped_gemm_triton`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.common.triton_kernels import LazyKernel, _interpreting, require_launchable
from backends.common.triton_launch import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = [
    "MAX_SPLITS",
    "MIN_PROGRAMS",
    "TileConfig",
    "invariant_contract",
    "invariant_linear",
    "invariant_mm",
    "invariant_mm_reference",
    "narrow_block_n",
    "tile_config",
]

MIN_PROGRAMS = 128
"""Programs one row tile should spread over (about the H200's 132 SMs): ``BLOCK_N`` is the
widest that still gives this many column tiles over the weight's groups, so a decode-sized
GEMM (one row tile) reads its weight from most of the card. A constant, not the device's
SM count, so the configuration is the same on every device."""

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

_SUM_BLOCK = 512
"""Columns per program of the split sum."""


MAX_SPLITS = 16
"""At most this many ``K`` splits: each adds an fp32 partial per output element."""

MIN_SPLIT_STEPS = 4
"""Each split walks at least this many ``BLOCK_K`` steps (the pipeline's depth)."""


class TileConfig(tuple):
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, splits)``."""

    __slots__ = ()

    def __new__(
        cls, bm: int, bn: int, bk: int, warps: int, stages: int, splits: int = 1
    ) -> TileConfig:
        return super().__new__(cls, (bm, bn, bk, warps, stages, splits))

    @property
    def splits(self) -> int:
        return self[5]


def tile_config(n: int, k: int, groups: int, ieee: bool) -> TileConfig:
    """The one tile configuration of a weight: from its ``N``, ``K``, group count and
    whether it multiplies in IEEE fp32, never from the batch's rows.

    16-bit: 64-row tiles (one Hopper warpgroup MMA) and 64-deep K steps, 4-stage
    pipeline, ``BLOCK_N`` 128 (the weight's width below that): wide loads keep enough
    bytes in flight per SM to read a decode GEMM's weight at HBM speed. Where the column
    tiles over the groups are fewer than ``MIN_PROGRAMS``, ``K`` is cut into the fewest
    power-of-two splits that reach it (at most ``MAX_SPLITS``, each at least
    ``MIN_SPLIT_STEPS`` K steps). IEEE fp32 (CUDA-core FMAs, where a wasted row costs as
    much as a used one): 16-row tiles and 32-deep K steps, ``BLOCK_N`` the widest of
    128..16 that keeps ``MIN_PROGRAMS`` column tiles, split likewise."""
    if ieee:
        bn = narrow_block_n(n, groups)
        bk = min(32, max(16, next_power_of_2(k)))
        return TileConfig(16, bn, bk, 4, 3, _splits(n, k, groups, bn, bk))
    bn = min(128, max(16, next_power_of_2(n)))
    bk = min(64, max(16, next_power_of_2(k)))
    return TileConfig(64, bn, bk, 4, 4, _splits(n, k, groups, bn, bk))


def narrow_block_n(n: int, groups: int) -> int:
    """The widest ``BLOCK_N`` of 128..16 that keeps ``MIN_PROGRAMS`` column tiles over the
    groups (16 if none does), and no wider than the weight."""
    bn = 16
    for width in (128, 64, 32):
        if groups * cdiv(n, width) >= MIN_PROGRAMS:
            bn = width
            break
    return min(bn, max(16, next_power_of_2(n)))


def _splits(n: int, k: int, groups: int, bn: int, bk: int) -> int:
    """The fewest power-of-two ``K`` splits giving ``MIN_PROGRAMS`` programs per row tile."""
    tiles, steps, splits = groups * cdiv(n, bn), cdiv(k, bk), 1
    while (
        tiles * splits < MIN_PROGRAMS
        and splits < MAX_SPLITS
        and steps >= 2 * splits * MIN_SPLIT_STEPS
    ):
        splits *= 2
    return splits


def _invariant_mm_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    bias_ptr,
    m,
    n,
    k,
    sa_g,
    sa_m,
    sa_k,
    sb_g,
    sb_k,
    sb_n,
    so_g,
    so_m,
    so_n,
    k_split,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    groups = tl.num_programs(2) // SPLITS
    g = tl.program_id(2).to(tl.int64) // SPLITS
    split = tl.program_id(2) % SPLITS
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < m
    col_ok = cols < n
    a_rows = a_ptr + g * sa_g + rows.to(tl.int64)[:, None] * sa_m
    b_cols = b_ptr + g * sb_g + cols.to(tl.int64)[None, :] * sb_n
    acc = tl.zeros([BM, BN], tl.float32)
    k_first = split * k_split  # this split's K range, walked in order: the same for every row
    k_end = tl.minimum(k_first + k_split, k)
    for k0 in range(k_first, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < k_end
        a = tl.load(a_rows + ks[None, :] * sa_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * sb_k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # fp32 products: IEEE fp32, the interpreter, or mixed operand dtypes
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS > 1:  # an fp32 partial [split, g, row, col]; the bias comes after the sum
        at = ((split * groups + g) * m + rows.to(tl.int64)[:, None]) * n
        tl.store(out_ptr + at + cols[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + g * so_g + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sum_splits_kernel(
    out_ptr,
    part_ptr,
    bias_ptr,
    m,
    n,
    groups,
    so_g,
    so_m,
    so_n,
    BN: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """``out[g, row] = sum over splits, in split order, of part[split, g, row] (+ bias)``,
    rounded once: the same additions for every row."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = cols < n
    acc = tl.load(part_ptr + (g * m + row) * n + cols, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + ((split * groups + g) * m + row) * n + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + g * so_g + row * so_m + cols * so_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


_invariant_mm = LazyKernel(_invariant_mm_kernel, only=(["m"], []))
"""Only ``m`` unspecialised: the row count changes every batch and must neither compile a
new variant nor select a different one (``m == 1`` would)."""

_sum_splits = LazyKernel(_sum_splits_kernel, only=(["m"], []))


def invariant_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N] (+ bias [N])`` -> ``[G, M, N]`` in ``out_dtype`` (``a``'s
    by default); 2-D ``a [M, K] @ b [K, N]`` likewise. Any strides (``b`` is typically a
    transposed ``nn.Linear`` weight, a view). ``out``: a ``[G, M, N]`` (or ``[M, N]``) view
    to write into (e.g. a permuted ``[M, G, N]`` buffer), returned. ``config``: another
    tile configuration than ``tile_config``'s (the benchmark's sweep; tests)."""
    flat = a.dim() == 2
    if flat:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
        out = None if out is None else out.unsqueeze(0)
    groups, m, k = a.shape
    if b.dim() != 3 or b.shape[0] != groups or b.shape[1] != k:
        raise ValueError(f"invariant_mm: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    if a.dtype not in _FLOATS or b.dtype not in _FLOATS:
        raise ValueError(f"invariant_mm takes float operands, not {a.dtype} and {b.dtype}")
    n = b.shape[2]
    out_dtype = out_dtype or a.dtype
    require_launchable(a.device, "dot")
    ieee = torch.float32 in (a.dtype, b.dtype)
    # The interpreter's 16-bit dot is wrong and its fp32 -> bf16 cast truncates: there the
    # products are fp32 and torch rounds the fp32 result (compiled: round to nearest even).
    emulate = _interpreting() and out_dtype != torch.float32
    target = out
    if target is None or emulate:
        target = torch.empty(
            groups, m, n, dtype=torch.float32 if emulate else out_dtype, device=a.device
        )
    if m and n and groups:
        bm, bn, bk, warps, stages, splits = config or tile_config(n, k, groups, ieee)
        k_split = triton.cdiv(triton.cdiv(k, bk), splits) * bk  # whole K steps per split
        parts = target
        if splits > 1:
            parts = torch.empty(splits, groups, m, n, dtype=torch.float32, device=a.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), groups * splits)
        _invariant_mm[grid](
            parts,
            a,
            b,
            target if bias is None else bias,
            m,
            n,
            k,
            *a.stride(),
            *b.stride(),
            *target.stride(),
            k_split,
            BM=bm,
            BN=bn,
            BK=bk,
            SPLITS=splits,
            HAS_BIAS=bias is not None,
            IEEE=ieee,
            UPCAST=ieee or _interpreting(),
            num_warps=warps,
            num_stages=stages,
        )
        if splits > 1:
            _sum_splits[(m, triton.cdiv(n, _SUM_BLOCK), groups)](
                target,
                parts,
                target if bias is None else bias,
                m,
                n,
                groups,
                *target.stride(),
                BN=_SUM_BLOCK,
                SPLITS=splits,
                HAS_BIAS=bias is not None,
                num_warps=4,
            )
    if emulate:
        if out is None:
            out = target.to(out_dtype)
        else:
            out.copy_(target)
    elif out is None:
        out = target
    return out.squeeze(0) if flat else out


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``invariant_mm``: ``x [..., K]``, ``weight
    [N, K]`` -> ``[..., N]`` in ``out_dtype`` (``x``'s by default), fp32 accumulation."""
    rows = x.reshape(-1, x.shape[-1])
    y = invariant_mm(rows, weight.t(), bias=bias, out_dtype=out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def invariant_contract(
    equation: str, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The model's einsums of activations ``x`` by weights ``w``, through ``invariant_mm``:

    - ``"rhd,hdc->rhc"`` (MLA query absorption) and ``"rhc,hdc->rhd"`` (the value
      up-projection): one GEMM per head, batched over the head dim (views, no copies);
    - ``"rd,ed->re"`` (the MoE gate): a plain linear.
    """
    if equation == "rd,ed->re":
        return invariant_linear(x, w, out_dtype=dtype)
    rows, heads = x.shape[0], x.shape[1]
    if equation == "rhd,hdc->rhc":
        b = w  # [H, d, c]
    elif equation == "rhc,hdc->rhd":
        b = w.transpose(1, 2)  # [H, c, d]
    else:
        raise ValueError(f"no batch-invariant kernel for the contraction {equation!r}")
    out = torch.empty(rows, heads, b.shape[2], dtype=dtype, device=x.device)
    invariant_mm(x.transpose(0, 1), b, out_dtype=dtype, out=out.transpose(0, 1))
    return out


def invariant_mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The exact reference: the float64 product (``+ bias``) rounded once to ``out_dtype``."""
    y = torch.matmul(a.double(), b.double())
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or a.dtype)


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None
) -> torch.Tensor:
    """``F.linear`` in float64 rounded once: ``invariant_linear``'s reference."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b).to(out_dtype or x.dtype)
