"""LayerNorm as one Triton launch, optionally with the indexer's key rope fused in.

In torch, ``LayerNorm.forward`` is three kernels on CUDA (cast to fp32, ``F.layer_norm``,
cast back) and the indexer's key then takes a fourth for its rope, once a layer each:
at 61 layers that is ~250 launches a decode step for a ``[rows, 128]`` tensor, each
costing more in launch and idle time than in bytes. Here one program reads a tile of
rows once, normalises them in registers and writes them, and, when asked, applies the
half-split rope to the leading ``rope_dim`` features in the same launch.

Numerics: fp32 throughout, like the torch path on the GPU. Mean and (biased) variance are
two passes over the row in registers (``sum(x) / D``, then ``sum((x - mean)**2) / D``,
each as a multiply by ``fp32(1/D)``); the output is ``(x - mean) * rsqrt(var + eps) * w
+ b``, one rounding per operation (fp fusion off, so no fma), rounded once to ``x``'s
dtype. torch's CUDA kernel uses Welford's update and an fma-contracted output instead, so
the two agree to a few fp32 ulps, not bit for bit (tests/gpu bounds the difference).

bf16 outputs are rounded to nearest even with integer arithmetic rather than ``.to``:
the interpreter truncates fp32 to bf16 where the GPU rounds, and the interpreter tests
are meant to check the GPU's rounding. (The compiled ``.to`` rounds the same way, so on
the GPU this changes nothing.)

The fused rope is ``rope_triton._rope_half_kernel``'s math on the normed and *rounded*
values, i.e. exactly ``apply_rope_half_leading(layer_norm(x))``: the program stores the
normed row, waits at a barrier, reloads the rope pairs from its own output and overwrites
them. Reloading, rather than pairing features inside registers, keeps the norm's
reduction the very code (and so the very summation order) of the unfused kernel, which
is what makes the fused result bit-equal to the two-launch composition.

Feature sizes are compile-time constants (one variant per model); row counts, strides and
eps are runtime values, unspecialised by ``LazyKernel``. The launch allocates through torch
and never syncs, so it can be captured in a CUDA graph. On the CPU it runs under
``TRITON_INTERPRET=1``, which is how it is tested; the CPU model keeps the float64 torch norm.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, require_launchable, row_align, rows_view

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["layer_norm_rope_triton", "layer_norm_triton"]

# Elements per program: for the indexer's 128-wide keys, 16 rows a program, so a decode
# batch is one or two programs and not one per row.
_TILE = 2048
# Launch keywords: no fma contraction, as rope_triton's kernels (the fused rope must be
# bit-equal to them) and so the norm's products round as the unfused launch's do.
_EXACT = {"enable_fp_fusion": False}


def _layer_norm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    vectors,
    heads,
    x_stride,
    cos_stride,
    sin_stride,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    # Offsets in int64: vectors * stride passes 2**31 in a long prefill.
    vec = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = vec < vectors
    x_row = vec * x_stride
    if ROW_ALIGN > 1:
        # The launcher checked that the row stride is a multiple of ROW_ALIGN elements;
        # without the hint the unspecialised stride would make every load a scalar one.
        x_row = tl.multiple_of(x_row, ROW_ALIGN)
    out_row = vec * D
    cols = tl.arange(0, BLOCK)
    in_row = cols < D
    mask = live[:, None] & in_row[None, :]
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    # Times fp32(1/D), as torch's CUDA reductions divide. Masked lanes read 0 and are
    # zeroed again after the centring, so they add nothing to either sum.
    mean = tl.sum(x, axis=1) * (1.0 / D)
    centred = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) * (1.0 / D)
    y = centred * tl.rsqrt(var + eps)[:, None] * w[None, :] + b[None, :]
    dtype = out_ptr.dtype.element_ty
    if ROUND_BF16:
        # To nearest even on the upper 16 bits; a NaN is kept as it is (the carry of
        # 0x7FFFFFFF would turn it into -0).
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000 as an int32
        y = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    out_at = out_ptr + out_row[:, None]
    tl.store(out_at + cols[None, :], y.to(dtype), mask=mask)
    if HALF > 0:
        # The rounded normed row is in memory now; once every thread's stores are visible
        # to the whole program, each rope pair is read back from there.
        tl.debug_barrier()
        pair = tl.arange(0, HALF_BLOCK)
        pm = live[:, None] & (pair < HALF)[None, :]
        row = vec // heads
        p = pair[None, :]
        a = tl.load(out_at + p, mask=pm, other=0.0).to(tl.float32)
        bb = tl.load(out_at + HALF + p, mask=pm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + (row * cos_stride)[:, None] + p, mask=pm, other=0.0)
        s = tl.load(sin_ptr + (row * sin_stride)[:, None] + p, mask=pm, other=0.0)
        c = c.to(tl.float32)
        s = s.to(tl.float32)
        tl.store(out_at + p, (a * c - bb * s).to(dtype), mask=pm)
        tl.store(out_at + HALF + p, (a * s + bb * c).to(dtype), mask=pm)


_layer_norm = LazyKernel(_layer_norm_kernel, aligned=True)


def _num_warps(rows: int, block: int) -> int:
    # About 16 fp32 values a thread, at most 8 warps: a tuning knob only (results do not
    # depend on it beyond the reductions' order, the same for fused and unfused launches).
    return min(max(rows * block // 512, 1), 8)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    require_launchable(x.device, "sum")
    if x.dim() == 0:
        raise ValueError("layer_norm_triton needs at least one dimension")
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if not x.dtype.is_floating_point or x.dtype == torch.float64:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")


def _rope_tables(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` as ``[rows, rope_dim / 2]`` with unit feature stride (a broadcast
    single row stays a stride-0 view), after the checks rope_triton makes."""
    d = x.shape[-1]
    if x.dim() < 2:
        raise ValueError(f"x must be [rows, ..., d] for the rope, got shape {tuple(x.shape)}")
    if rope_dim % 2 or not 0 < rope_dim <= d:
        raise ValueError(f"rope_dim must be even and in (0, {d}], got {rope_dim}")
    half = rope_dim // 2
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[-1] != half:
        raise ValueError(
            f"cos/sin must both be [rows, {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos/sin on {cos.device}/{sin.device}, x on {x.device}")
    rows = x.shape[0]
    cos, sin = cos.expand(rows, half), sin.expand(rows, half)
    return (
        cos if cos.stride(-1) == 1 else cos.contiguous(),
        sin if sin.stride(-1) == 1 else sin.contiguous(),
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None,
) -> torch.Tensor:
    _check(x, weight, bias)
    cos, sin, half = x, x, 0  # placeholders the kernel never reads when HALF == 0
    if rope is not None:
        cos, sin = _rope_tables(x, rope[0], rope[1], rope[2])
        half = rope[2] // 2
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = rows_view(x)
    vectors = x2.shape[0]
    # One row: its offset is 0 whatever the stride, so report D and keep the variant
    # (ROW_ALIGN) the same as for many rows of a contiguous input.
    stride = x2.stride(0) if vectors > 1 else d
    block = triton.next_power_of_2(d)
    rows = max(_TILE // block, 1)
    _layer_norm[(triton.cdiv(vectors, rows),)](
        out,
        x2,
        weight.contiguous(),
        bias.contiguous(),
        cos,
        sin,
        vectors,
        vectors // x.shape[0],
        stride,
        cos.stride(0),
        sin.stride(0),
        float(eps),
        D=d,
        BLOCK=block,
        ROWS=rows,
        ROW_ALIGN=row_align(stride, x.dtype),
        ROUND_BF16=x.dtype == torch.bfloat16,
        HALF=half,
        HALF_BLOCK=triton.next_power_of_2(max(half, 1)),
        num_warps=_num_warps(rows, block),
        **_EXACT,
    )
    return out


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim in fp32 with ``weight``/``bias [D]`` (read as
    fp32), as a new contiguous tensor of ``x``'s shape and dtype (float32, bfloat16 or
    float16). Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    return _launch(x, weight, bias, eps, None)


def layer_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
) -> torch.Tensor:
    """``rope_half_leading_triton(layer_norm_triton(x, ...), cos, sin, rope_dim)`` bit for
    bit, in one launch: ``x [rows, ..., D]``, ``cos``/``sin [rows or 1, rope_dim / 2]``."""
    return _launch(x, weight, bias, eps, (cos, sin, rope_dim))
