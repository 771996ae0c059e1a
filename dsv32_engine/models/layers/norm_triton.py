"""RMSNorm as one Triton launch, for CUDA tensors.

In torch the norm is a chain of about seven elementwise and reduction kernels (casts, square,
mean, add, rsqrt, two multiplies); it runs four times a layer, so a 61-layer decode step
spent a few hundred launches on it, each moving a few KB. Here a program owns one row:
it reads the row once, reduces it in registers and writes the result, all in fp32 like
``RMSNorm``'s torch path on the GPU.

Only the feature size ``D`` is a compile-time constant (a model constant: 7168, 1536,
512); row counts and row strides are runtime values, unspecialised by ``LazyKernel``, so
a new batch shape never compiles mid-serving. The launch reads nothing back to the host
and allocates through torch, so it can be captured in a CUDA graph.

On the CPU it runs under ``TRITON_INTERPRET=1``, which is how it is tested without a GPU;
the model itself never takes that path (its CPU norm stays the float64 torch one).
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

__all__ = ["add_rms_norm_triton", "rms_norm_triton"]


def _rms_norm_kernel(
    out_ptr,
    sum_ptr,
    x_ptr,
    delta_ptr,
    w_ptr,
    x_stride,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    # Row offsets in int64: rows * stride passes 2**31 in a long prefill.
    row = tl.program_id(0).to(tl.int64)
    x_row = row * x_stride
    out_row = row * D
    if ROW_ALIGN > 1:
        # The launcher checked that the row stride is a multiple of ROW_ALIGN elements;
        # without the hint the unspecialised stride would make every load a scalar one.
        x_row = tl.multiple_of(x_row, ROW_ALIGN)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0)
    if RESIDUAL:
        # The residual stream's ``h + delta``, rounded to h's dtype exactly as torch's
        # elementwise add rounds it, stored, then normalised from those rounded bits: the
        # same values the separate add and norm launches produced.
        d = tl.load(delta_ptr + out_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + out_row + cols, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum. Times 1/D (rounded to fp32),
    # as torch's CUDA mean does, rather than a division.
    mean_sq = tl.sum(x * x, axis=0) * (1.0 / D)
    # Same order of operations as the torch path: normalise, then scale.
    y = (x * tl.rsqrt(mean_sq + eps)) * w
    tl.store(out_ptr + out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm = LazyKernel(_rms_norm_kernel, aligned=True)


def norm_warps(block: int) -> int:
    # Triton's layer-norm heuristic: about 32 fp32 values a thread at most, at most
    # 8 warps. A tuning knob only; results do not depend on it beyond summation order.
    return min(max(block // 256, 1), 8)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, in fp32, returned as a new contiguous
    tensor of ``x``'s shape and dtype. ``weight`` is ``[D]`` (any float dtype, read as
    fp32). Needs CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + delta`` rounded to ``x``'s dtype, in one launch.

    The decoder's residual stream adds each sub-layer's output and normalises the sum for
    the next one; as two launches that is an add kernel and a norm kernel per sub-layer.
    Both results are bit-equal to ``x + delta`` followed by :func:`rms_norm_triton` (same
    kernel, same reduction). ``delta`` has ``x``'s shape and dtype."""
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(
            f"delta must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
            f"{delta.dtype} {tuple(delta.shape)} on {delta.device}"
        )
    if x.dtype == torch.float64:
        raise ValueError("the fused residual add takes 16- or 32-bit floats (it adds in fp32)")
    out, total = _launch(x, delta, weight, eps)
    return total, out


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = x.device
    require_launchable(device, "sum")
    if x.dim() == 0:
        raise ValueError("rms_norm_triton needs at least one dimension")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device}, x on {device}")
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point):
        raise ValueError(f"floating-point tensors only, got {x.dtype} and {weight.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    total = None if delta is None else torch.empty(x.shape, dtype=x.dtype, device=device)
    if out.numel() == 0:
        return out, total
    x2 = rows_view(x)
    rows = x2.shape[0]
    # One row: its offset is 0 whatever the stride, so report D and keep the variant
    # (ROW_ALIGN) the same as for many rows of a contiguous input.
    stride = x2.stride(0) if rows > 1 else d
    block = triton.next_power_of_2(d)
    # Without a residual the sum and delta pointers are never read: ``out`` stands in.
    delta2 = out if delta is None else delta.contiguous().view(rows, d)
    _rms_norm[(rows,)](
        out,
        out if total is None else total,
        x2,
        delta2,
        weight.contiguous(),
        stride,
        float(eps),
        D=d,
        BLOCK=block,
        ROW_ALIGN=row_align(stride, x.dtype),
        RESIDUAL=delta is not None,
        num_warps=norm_warps(block),
    )
    return out, total
