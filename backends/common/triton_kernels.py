"""Triton versions of the metadata kernels, bit-identical to ``generic_torch``.

The planner rebuilds these tables for every forward batch, often inside a captured
CUDA graph, where a chain of small torch ops costs a launch each; here every table
is one launch. Launchers share the reference's signatures and checks, derive block
sizes from shapes only (no host sync, capture-safe) and run on CPU tensors under
``TRITON_INTERPRET=1``, which is how they are tested without a GPU.

Kernels are plain functions handed to ``triton.jit`` on first launch rather than at
import: ``triton.jit`` decides between interpreter and compiler when it decorates,
so eager decoration would freeze whatever ``TRITON_INTERPRET`` held when some other
module happened to import this one first. Triton's own library functions (``tl.sum``,
``tl.cumsum``, ...) are frozen the same way when ``triton.language`` is imported; the
only kernel that uses them has an interpreter twin for that case. The reverse order
(``triton`` imported under ``TRITON_INTERPRET=1``, kernels compiled later) is not
supported, by Triton itself either.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common import torch_ref as ref
from backends.common.triton_launch import LazyKernel, _interpreting, unspecialised  # noqa: F401 (re-exported)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None
    tl = None

__all__ = [
    "causal_lengths",
    "clamp_into",
    "cumsum_with_zero",
    "gather_token_slots",
    "page_table_from_slots",
    "triton_available",
    "uniform_offsets",
]

# 1-D elementwise and 2-D column blocks: big enough to amortise the per-program
# cost, small enough to keep registers per thread low on any GPU.
_MAX_BLOCK = 1024
# The scan runs in a single program, so it takes wider steps to need fewer of them.
_MAX_SCAN_BLOCK = 4096


def triton_available(device: torch.device) -> bool:
    """Lets the planner pick a provider per device without trying a launch: compiled
    Triton needs CUDA, anything else needs the interpreter."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return _interpreting()
    return False


def require_launchable(device: torch.device, uses: str) -> None:
    """Refuse, before any work, a launch Triton cannot run: off CUDA without the interpreter,
    or under it once ``triton.language`` was imported compiled-only (its standard library,
    ``tl.<uses>`` among it, is then frozen). Shared by the forward's kernels' launchers."""
    if not triton_available(device):
        raise RuntimeError(
            f"Triton cannot run on {device}: it needs CUDA, or CPU tensors with TRITON_INTERPRET=1"
        )
    if device.type == "cpu" and not _stdlib_interpretable():
        raise RuntimeError(
            f"triton.language was imported before TRITON_INTERPRET=1: its {uses} cannot be "
            "interpreted; set TRITON_INTERPRET before importing triton"
        )


_VECTOR_BYTES = 16
"""The widest load a thread issues."""


def row_align(stride: int, dtype: torch.dtype) -> int:
    """The largest power of two (in elements, up to one 16-byte vector) dividing ``stride``:
    what a row-wise forward kernel may promise (``tl.multiple_of``) about where each row or
    vector starts. A model's strides are fixed for a run, so this is one compiled variant a
    dtype, not one a batch."""
    align = max(_VECTOR_BYTES // dtype.itemsize, 1)
    while align > 1 and stride % align:
        align //= 2
    return align


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, D]`` with unit feature stride and one row stride, without a copy
    when the leading dims collapse (a row slice or a ``split`` of the last dim does)."""
    d = x.shape[-1]
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    x2 = x.reshape(-1, d)  # a view when the leading dims collapse; a copy otherwise
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _require(device: torch.device) -> None:
    if not triton_available(device):
        raise RuntimeError(
            f"Triton kernels cannot run on {device}: they need CUDA, or CPU tensors"
            " with TRITON_INTERPRET=1"
        )


def block_size(n: int, cap: int = _MAX_BLOCK) -> int:
    """Few distinct block sizes (64 up to ``cap``, by powers of 4), so few compiled variants."""
    block = 64
    while block < n and block < cap:
        block *= 4
    return min(block, cap)


# --- kernels -----------------------------------------------------------------------


def _cumsum_with_zero_kernel(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    # One program walks the whole input carrying the running total, so the result
    # is exact and independent of how programs would be scheduled. The total is a
    # full block so the loop-carried type never changes.
    offs = tl.arange(0, BLOCK)
    total = tl.full([BLOCK], 0, tl.int32)
    tl.store(out_ptr + offs, total, mask=offs == 0)
    for start in range(0, n, BLOCK):
        idx = start + offs
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0)
        tl.store(out_ptr + 1 + idx, tl.cumsum(x, axis=0) + total, mask=mask)
        total += tl.sum(x, axis=0)


def _cumsum_with_zero_interp_kernel(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    # Interpreter-only twin of the kernel above, for when triton.language was
    # imported before TRITON_INTERPRET was set: tl.cumsum / tl.sum are themselves
    # triton.jit functions, frozen as compiled-only at that import, and the
    # interpreter cannot call them. The reduce/scan builtins it patches still work.
    offs = tl.arange(0, BLOCK)
    total = tl.full([BLOCK], 0, tl.int32)
    tl.store(out_ptr + offs, total, mask=offs == 0)
    for start in range(0, n, BLOCK):
        idx = start + offs
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0)
        tl.store(out_ptr + 1 + idx, tl.associative_scan(x, 0, _SUM) + total, mask=mask)
        total += tl.reduce(x, 0, _SUM)


def _clamp_kernel(
    out_ptr, x_ptr, n, lo, hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if HAS_LO:
        x = tl.maximum(x, lo)
    if HAS_HI:
        x = tl.minimum(x, hi)
    tl.store(out_ptr + offs, x, mask=mask)


def _uniform_offsets_kernel(out_ptr, n, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, offs * step, mask=offs < n)


def _gather_token_slots_kernel(
    out_ptr, r2t_ptr, idx_ptr, seq_ptr, width, ctx, out_stride, r2t_stride, BLOCK: tl.constexpr
):
    # Grid: (column blocks, requests). Row offsets go through int64 because
    # pool * ctx and reqs * width can exceed int32.
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    pool = tl.load(idx_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_ptr + row)
    take = in_row & (cols < seq_len) & (cols < ctx)
    slots = tl.load(r2t_ptr + pool * r2t_stride + cols, mask=take, other=0)
    tl.store(out_ptr + row * out_stride + cols, slots, mask=in_row)


def _page_table_kernel(
    out_ptr, slots_ptr, pages, width, page_size, out_stride, slots_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(1).to(tl.int64)
    page = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = page < pages
    first = page.to(tl.int64) * page_size
    take = in_row & (first < width)
    slot = tl.load(slots_ptr + row * slots_stride + first, mask=take, other=0)
    # Integer division truncates toward zero; step down to match torch's floor.
    quot = slot // page_size
    quot = tl.where(quot * page_size > slot, quot - 1, quot)
    tl.store(out_ptr + row * out_stride + page, quot, mask=in_row)


def _causal_lengths_kernel(out_ptr, seq_ptr, total, NEXT_N: tl.constexpr, BLOCK: tl.constexpr):
    # NEXT_N is a compile-time constant: it takes few values (draft lengths) and
    # makes the divisions below cheap.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    req = offs // NEXT_N
    tok = offs - req * NEXT_N
    seq_len = tl.load(seq_ptr + req, mask=mask, other=0)
    tl.store(out_ptr + offs, seq_len - (NEXT_N - 1 - tok), mask=mask)


def _add_combine(a, b):
    return a + b


def _interp_sum_combine() -> Any:
    # The interpreter recognises triton's own sum combiner by identity and runs it
    # as one numpy call; any other combiner is applied element by element in Python.
    own = getattr(getattr(tl, "standard", None), "_sum_combine", None)
    return own if own is not None else triton.JITFunction(_add_combine)


def _stdlib_interpretable() -> bool:
    # Compiled-only stdlib functions are JITFunctions; interpretable ones are not.
    return not isinstance(tl.cumsum, triton.JITFunction)


_SUM = _interp_sum_combine() if triton is not None else None
_cumsum_with_zero = LazyKernel(_cumsum_with_zero_kernel)
_cumsum_with_zero_interp = LazyKernel(_cumsum_with_zero_interp_kernel)
_clamp = LazyKernel(_clamp_kernel)
_uniform_offsets = LazyKernel(_uniform_offsets_kernel)
_gather_token_slots = LazyKernel(_gather_token_slots_kernel)
_page_table = LazyKernel(_page_table_kernel)
_causal_lengths = LazyKernel(_causal_lengths_kernel)


# --- launchers ---------------------------------------------------------------------


def cumsum_with_zero(out: torch.Tensor, x: torch.Tensor) -> None:
    """See ``generic_torch.cumsum_with_zero``; one program, so cost grows with n but
    no partial sums ever cross programs."""
    ref.check_cumsum_with_zero(out, x)
    _require(out.device)
    n = x.shape[0]
    kernel = _cumsum_with_zero
    if _interpreting() and not _stdlib_interpretable():
        kernel = _cumsum_with_zero_interp
    kernel.launch((1,), out, x, n, BLOCK=block_size(n, _MAX_SCAN_BLOCK))


def clamp_into(out: torch.Tensor, x: torch.Tensor, lo: int | None, hi: int | None) -> None:
    """See ``generic_torch.clamp_into``."""
    ref.check_clamp_into(out, x, lo, hi)
    _require(out.device)
    n = x.shape[0]
    if n == 0:
        return
    block = block_size(n)
    _clamp.launch(
        (triton.cdiv(n, block),),
        out,
        x,
        n,
        0 if lo is None else lo,
        0 if hi is None else hi,
        HAS_LO=lo is not None,
        HAS_HI=hi is not None,
        BLOCK=block,
    )


def uniform_offsets(out: torch.Tensor, step: int) -> None:
    """See ``generic_torch.uniform_offsets``."""
    ref.check_uniform_offsets(out, step)
    _require(out.device)
    n = out.shape[0]
    if n == 0:
        return
    block = block_size(n)
    _uniform_offsets.launch((triton.cdiv(n, block),), out, n, step, BLOCK=block)


def gather_token_slots(
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """See ``generic_torch.gather_token_slots``; columns go on grid axis 0, whose
    limit is far larger than axis 1's, so wide rows never overflow the grid."""
    ref.check_gather_token_slots(out, req_to_token, req_pool_indices, seq_lens)
    _require(out.device)
    reqs, width = out.shape
    if reqs == 0 or width == 0:
        return
    block = block_size(width)
    _gather_token_slots.launch(
        (triton.cdiv(width, block), reqs),
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        width,
        req_to_token.shape[1],
        out.stride(0),
        req_to_token.stride(0),
        BLOCK=block,
    )


def page_table_from_slots(out: torch.Tensor, token_slots: torch.Tensor, page_size: int) -> None:
    """See ``generic_torch.page_table_from_slots``."""
    ref.check_page_table_from_slots(out, token_slots, page_size)
    _require(out.device)
    reqs, pages = out.shape
    if reqs == 0 or pages == 0:
        return
    block = block_size(pages)
    _page_table.launch(
        (triton.cdiv(pages, block), reqs),
        out,
        token_slots,
        pages,
        token_slots.shape[1],
        page_size,
        out.stride(0),
        token_slots.stride(0),
        BLOCK=block,
    )


def causal_lengths(out: torch.Tensor, seq_lens: torch.Tensor, next_n: int) -> None:
    """See ``generic_torch.causal_lengths``."""
    ref.check_causal_lengths(out, seq_lens, next_n)
    _require(out.device)
    total = out.shape[0]
    if total == 0:
        return
    block = block_size(total)
    _causal_lengths.launch(
        (triton.cdiv(total, block),), out, seq_lens, total, NEXT_N=next_n, BLOCK=block
    )
