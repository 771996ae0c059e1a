"""SwiGLU's ``silu(gate) * up`` as one Triton launch, for the CUDA forward.

In torch it is two kernels (the silu, then the multiply) with a full ``[rows, inter]``
tensor written and read back between them; it runs in every dense layer, every MoE
layer's shared expert and between the routed experts' grouped GEMMs, about 0.3 ms of a
61-layer decode step in launches alone. Here one program reads a block of ``gate`` and
``up`` once and writes the product once.

Numerics copy torch's CUDA kernels, roundings included, so the kernel changes no bits:
torch's silu computes ``x / (1 + expf(-x))`` in fp32 (IEEE division) and rounds to the
input dtype, then the multiply widens both bf16 operands to fp32, multiplies and rounds
again. The kernel does the same two roundings. Its exp is libdevice's ``expf``, the
implementation CUDA's ``expf`` is, rather than ``tl.exp`` (``ex2.approx`` on a scaled
argument, a few fp32 ulps off, enough to flip a bf16 rounding now and then); its division
is ``div_rn``, since Triton's ``/`` is the approximate ``div.full.f32``. Where libdevice
cannot be imported the kernel falls back to ``tl.exp``: then a result may differ from
torch's by one ulp of the output dtype, rarely (the GPU test bounds both).

``gate`` and ``up`` are addressed through their row strides, so the two column halves of
one fused ``[rows, 2 * inter]`` GEMM output are read in place. Sizes and strides are
runtime values, unspecialised (``LazyKernel``), and the grid comes from shapes alone: no
compile when the batch changes, no host sync, capturable in a CUDA graph. On the CPU the
kernel runs under ``TRITON_INTERPRET=1`` (with numpy's exp) for the tests; the CPU model
itself keeps the float64 ``exact.silu``.
"""

from __future__ import annotations

import torch

from backends.common import triton_kernels as tk
from backends.common.triton_kernels import (
    LazyKernel,
    require_launchable,
    row_align,
    rows_view,
)
from dsv32_engine.models.layers.exact import forward_takes_kernel, silu

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the Triton release
    try:
        from triton.language.extra.cuda import libdevice
    except ImportError:
        libdevice = None

__all__ = ["HAS_LIBDEVICE_EXP", "exp_is_libdevice", "silu_mul", "silu_mul_triton"]

HAS_LIBDEVICE_EXP = libdevice is not None and hasattr(libdevice, "exp")
"""Whether the compiled kernel's exp is CUDA's own ``expf`` (bit-equal to torch)."""


def exp_is_libdevice() -> bool:
    """The ``LIBDEVICE_EXP`` flag of a launch now: libdevice's exp where it exists and the
    kernel is compiled (the interpreter cannot run libdevice, ``tl.exp`` stands in)."""
    return HAS_LIBDEVICE_EXP and not tk._interpreting()


# Columns a program: 16-byte vectors over 4 warps for bf16, few programs at decode sizes
# (16 rows x 18432 columns is 288 of them); a tuning knob only, results do not depend on it.
_BLOCK = 1024
_NUM_WARPS = 4
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _silu_mul_kernel(
    out_ptr,
    gate_ptr,
    up_ptr,
    n_cols,
    gate_stride,
    up_stride,
    BLOCK: tl.constexpr,
    GATE_ALIGN: tl.constexpr,
    UP_ALIGN: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    # Grid: (column blocks, rows); axis 0's limit is the large one. Offsets in int64:
    # rows * 2 * inter passes 2**31 in a long prefill of the routed experts.
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g_row = row * gate_stride
    u_row = row * up_stride
    o_row = row * n_cols
    # The launcher checked these divisibilities; without the hints the unspecialised
    # strides would make every access a scalar one.
    if GATE_ALIGN > 1:
        g_row = tl.multiple_of(g_row, GATE_ALIGN)
    if UP_ALIGN > 1:
        u_row = tl.multiple_of(u_row, UP_ALIGN)
    if OUT_ALIGN > 1:
        o_row = tl.multiple_of(o_row, OUT_ALIGN)
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + u_row + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    # torch's silu: fp32 math, IEEE division, rounded to the input dtype ...
    act = tl.math.div_rn(g, 1.0 + e).to(dtype)
    # ... then torch's multiply: both operands widened, one fp32 product, rounded again.
    tl.store(out_ptr + o_row + cols, (act.to(tl.float32) * u).to(dtype), mask=mask)


_silu_mul = LazyKernel(_silu_mul_kernel, aligned=True)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch, a new contiguous tensor of ``gate``'s shape and
    dtype (fp32, fp16 or bf16). ``gate``/``up`` ``[..., inter]`` may be column views of one
    GEMM output (any row stride, unit feature stride) or independent tensors. Needs CUDA,
    or CPU tensors under ``TRITON_INTERPRET=1``."""
    require_launchable(gate.device, "exp")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up shapes differ: {tuple(gate.shape)} vs {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up dtypes differ: {gate.dtype} vs {up.dtype}")
    if gate.dtype not in _FLOATS:
        raise ValueError(f"float32, float16 or bfloat16 only, got {gate.dtype}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device}, gate on {gate.device}")
    if gate.dim() == 0:
        raise ValueError("silu_mul_triton needs at least one dimension")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = rows_view(gate), rows_view(up)
    rows, n_cols = g2.shape
    # One row: its offset is 0 whatever the stride; report the width so a single-row
    # batch compiles nothing a contiguous one would not.
    g_stride = g2.stride(0) if rows > 1 else n_cols
    u_stride = u2.stride(0) if rows > 1 else n_cols
    dtype = gate.dtype
    _silu_mul[(triton.cdiv(n_cols, _BLOCK), rows)](
        out,
        g2,
        u2,
        n_cols,
        g_stride,
        u_stride,
        BLOCK=_BLOCK,
        GATE_ALIGN=row_align(g_stride, dtype),
        UP_ALIGN=row_align(u_stride, dtype),
        OUT_ALIGN=row_align(n_cols, dtype),
        # The interpreter cannot call libdevice; it evaluates tl.exp with numpy instead.
        LIBDEVICE_EXP=exp_is_libdevice(),
        num_warps=_NUM_WARPS,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation for the model: the kernel on CUDA, ``exact.silu(gate) * up``
    elsewhere (the CPU model's float64 silu) and wherever autograd needs a graph, which
    the kernel does not record."""
    if (
        up.is_cuda
        and gate.dtype in _FLOATS
        and gate.dtype == up.dtype
        and gate.shape == up.shape
        and forward_takes_kernel(gate, up)
    ):
        return silu_mul_triton(gate, up)
    return silu(gate) * up
