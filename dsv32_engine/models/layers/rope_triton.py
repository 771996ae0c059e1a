"""Rotary embeddings as one Triton launch each, for the CUDA forward.

The torch formulas in ``rope.py`` cost 8-10 elementwise kernels per call (cast, four
multiplies, add, sub, stack or cat, cast back); with MLA's query and key and the
indexer's query and key in each of 61 layers that is a large share of a decode step's
~7000 launches, each moving a few KB. Here each call is one launch that reads ``x`` once
and writes the result once.

Numerics follow the torch formula exactly: inputs go to fp32, ``a*c - b*s`` and
``a*s + b*c`` are evaluated as separate fp32 multiplies and an add/sub (fp fusion is
switched off, so neither the compiler nor ptxas contracts them into an fma), and the
result is rounded once to ``x``'s dtype. The indexer's untouched features are copied in
their own dtype, never through fp32.

``x`` is addressed through its row and head strides, because the model hands over split
views (MLA's ``q_rope`` is the last 64 of each 192-wide head); copying those first would
cost the launch this module exists to save. Only the feature dimension must be
contiguous. The feature sizes are compile-time constants (one variant per model and
dtype); rows, heads and strides are runtime values and not specialised on, so a new
batch shape never triggers a compile. The grid and the output come from shapes alone:
no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import LazyKernel, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = ["rope_half_leading_triton", "rope_interleaved_triton"]

# Elements per program: big enough to amortise the per-program cost, small enough that
# one fixed block of (row, head) vectors serves every batch, so a single variant compiles.
_TILE = 1024
# Launch keywords: keep the two products of each output apart (see the module docstring).
_EXACT = {"enable_fp_fusion": False}


def _rope_interleaved_kernel(
    out_ptr,
    x_ptr,
    cos_ptr,
    sin_ptr,
    n_vec,
    heads,
    x_row_stride,
    x_head_stride,
    cos_row_stride,
    sin_row_stride,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A "vector" is one (row, head) slice of d = 2 * HALF features; the program takes
    # BLOCK_N consecutive ones, so 2-D keys (one head) pack as densely as 3-D queries.
    vec = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = vec // heads
    head = vec - row * heads
    pair = tl.arange(0, HALF_BLOCK)
    mask = (vec < n_vec)[:, None] & (pair < HALF)[None, :]
    row64 = row.to(tl.int64)
    x_at = x_ptr + (row64 * x_row_stride + head.to(tl.int64) * x_head_stride)[:, None]
    x_at += 2 * pair[None, :]
    a = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_at + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + (row64 * cos_row_stride)[:, None] + pair[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + (row64 * sin_row_stride)[:, None] + pair[None, :], mask=mask, other=0.0)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    out_at = out_ptr + vec.to(tl.int64)[:, None] * (2 * HALF) + 2 * pair[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_at, (a * c - b * s).to(dtype), mask=mask)
    tl.store(out_at + 1, (a * s + b * c).to(dtype), mask=mask)


def _rope_half_kernel(
    out_ptr,
    x_ptr,
    cos_ptr,
    sin_ptr,
    n_vec,
    heads,
    x_row_stride,
    x_head_stride,
    cos_row_stride,
    sin_row_stride,
    DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Pairs (x[i], x[i + HALF]) for i < HALF rotate; features from 2 * HALF to DIM are
    # copied as they are, which is what the indexer's split + cat did in two more launches.
    vec = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = vec // heads
    head = vec - row * heads
    live = vec < n_vec
    pair = tl.arange(0, HALF_BLOCK)
    mask = live[:, None] & (pair < HALF)[None, :]
    row64 = row.to(tl.int64)
    x_vec = x_ptr + (row64 * x_row_stride + head.to(tl.int64) * x_head_stride)[:, None]
    out_vec = out_ptr + vec.to(tl.int64)[:, None] * DIM
    a = tl.load(x_vec + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_vec + HALF + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + (row64 * cos_row_stride)[:, None] + pair[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + (row64 * sin_row_stride)[:, None] + pair[None, :], mask=mask, other=0.0)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_vec + pair[None, :], (a * c - b * s).to(dtype), mask=mask)
    tl.store(out_vec + HALF + pair[None, :], (a * s + b * c).to(dtype), mask=mask)
    if DIM > 2 * HALF:
        col = 2 * HALF + tl.arange(0, PASS_BLOCK)
        keep = live[:, None] & (col < DIM)[None, :]
        rest = tl.load(x_vec + col[None, :], mask=keep, other=0.0)
        tl.store(out_vec + col[None, :], rest, mask=keep)


_rope_interleaved = LazyKernel(_rope_interleaved_kernel)
_rope_half = LazyKernel(_rope_half_kernel)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _prepare(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shapes on the host (metadata only: no sync) and returns the output plus
    ``x`` as ``[rows, heads, d]`` and ``cos``/``sin`` as ``[rows, half]``, views wherever
    the layout allows; ``cos``/``sin`` with one row broadcast over all rows like torch's."""
    if not triton_available(x.device):
        raise RuntimeError(
            f"Triton rope cannot run on {x.device}: it needs CUDA, or CPU tensors"
            " with TRITON_INTERPRET=1"
        )
    if x.dim() < 2:
        raise ValueError(f"x must be [rows, ..., d], got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[-1] != half:
        raise ValueError(
            f"cos/sin must both be [rows, {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos/sin on {cos.device}/{sin.device}, x on {x.device}")
    rows = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, x, cos, sin
    if x.stride(-1) != 1:
        x = x.contiguous()
    # reshape keeps a view for split heads and 2-D keys; only odd >3-D layouts copy.
    x3 = x.reshape(rows, -1, x.shape[-1])
    cos, sin = cos.expand(rows, half), sin.expand(rows, half)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if rows * x3.shape[1] > 2**31 - 1 - _TILE:
        raise ValueError(f"{rows} rows x {x3.shape[1]} heads overflow the int32 vector index")
    return out, x3, cos, sin


def _launch(kernel, out, x3, cos, sin, block_n: int, **constexprs: int) -> torch.Tensor:
    """Both layouts' launch: ``block_n`` (row, head) vectors a program over ``x3 [rows,
    heads, d]``, strides as runtime values, fp contraction off."""
    n_vec = x3.shape[0] * x3.shape[1]
    kernel[(triton.cdiv(n_vec, block_n),)](
        out,
        x3,
        cos,
        sin,
        n_vec,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        cos.stride(0),
        sin.stride(0),
        BLOCK_N=block_n,
        **constexprs,
        **_EXACT,
    )
    return out


def rope_interleaved_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope.apply_rope_interleaved`` in one launch; a new contiguous tensor in ``x``'s
    dtype. ``x [rows, ..., d]`` may be a strided view with a contiguous last dim."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"interleaved rope needs an even feature dim, got {d}")
    half = d // 2
    out, x3, cos, sin = _prepare(x, cos, sin, half)
    if out.numel() == 0:
        return out
    half_block = _pow2(half)
    block_n = max(1, _TILE // (2 * half_block))
    return _launch(_rope_interleaved, out, x3, cos, sin, block_n, HALF=half, HALF_BLOCK=half_block)


def rope_half_leading_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Half-split rope on the leading ``rope_dim`` features of ``x [rows, ..., D]``, the
    other ``D - rope_dim`` copied unchanged, in one launch (``rope_dim == D`` is
    ``rope.apply_rope_half``); a new contiguous tensor in ``x``'s dtype."""
    dim = x.shape[-1]
    if rope_dim % 2 or not 0 < rope_dim <= dim:
        raise ValueError(f"rope_dim must be even and in (0, {dim}], got {rope_dim}")
    half = rope_dim // 2
    out, x3, cos, sin = _prepare(x, cos, sin, half)
    if out.numel() == 0:
        return out
    block_n = max(1, _TILE // _pow2(dim))
    pass_block = _pow2(max(dim - rope_dim, 1))
    return _launch(
        _rope_half, out, x3, cos, sin, block_n,
        DIM=dim, HALF=half, HALF_BLOCK=_pow2(half), PASS_BLOCK=pass_block,
    )  # fmt: skip
