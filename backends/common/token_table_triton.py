"""The token table's two ops, ``gather_token_slots`` and ``page_table``, in one Triton launch.

Why: an eager NSA decode plan leaves exactly these two device steps after its host pass,
and on the H200's host each launch costs 31-34 us through the launcher's Python
(``benchmarks/eager_pieces.py``), a third of the whole plan. One launch writes both. The
page ids are read from the token table itself, not from the slots the same launch
writes, so no program waits on another's stores: ``page[r, p]`` is
``floor(slot / page_size)`` of the slot ``gather_token_slots`` writes at column
``p * page_size``, which is exactly ``page_table_from_slots`` of the gathered slots.

The planner runs it through ``planner.fusion`` only where both steps chose their Triton
providers; each result is bit-equal to the two torch references run one after the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common import torch_ref as ref
from backends.common.triton_kernels import LazyKernel, _require, block_size, tl
from planner.kernel_launch import KernelLaunch


def _token_table_kernel(
    slots_ptr,
    pages_ptr,
    r2t_ptr,
    idx_ptr,
    seq_ptr,
    width,
    ctx,
    pages,
    page_size,
    slots_stride,
    pages_stride,
    r2t_stride,
    BLOCK: tl.constexpr,
    PAGE_BLOCK: tl.constexpr,
):
    # Grid: (column blocks, requests); block b writes slot columns [b*BLOCK, (b+1)*BLOCK)
    # and page columns [b*PAGE_BLOCK, (b+1)*PAGE_BLOCK) of its row. int64 row offsets, as in
    # the separate kernels: pool * ctx and reqs * width can exceed int32.
    row = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    pool = tl.load(idx_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_ptr + row)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    take = in_row & (cols < seq_len) & (cols < ctx)
    slots = tl.load(r2t_ptr + pool * r2t_stride + cols, mask=take, other=0)
    tl.store(slots_ptr + row * slots_stride + cols, slots, mask=in_row)
    page = block * PAGE_BLOCK + tl.arange(0, PAGE_BLOCK)
    in_pages = page < pages
    first = page.to(tl.int64) * page_size
    read = in_pages & (first < width) & (first < seq_len) & (first < ctx)
    slot = tl.load(r2t_ptr + pool * r2t_stride + first, mask=read, other=0)
    # Integer division truncates toward zero; step down to match torch's floor.
    quot = slot // page_size
    quot = tl.where(quot * page_size > slot, quot - 1, quot)
    tl.store(pages_ptr + row * pages_stride + page, quot, mask=in_pages)


_token_table = LazyKernel(_token_table_kernel)
_I32 = torch.int32
_INDEX = (torch.int32, torch.int64)


def _plainly_valid(slots, pages, req_to_token, req_pool_indices, seq_lens, page_size) -> bool:
    """What the two references' checks accept, in one pass of fewer attribute reads (the
    checks cost 9 us on a CPU host, a launch's worth): True only where both would pass."""
    device = slots.device
    reqs = slots.shape[0]
    return (
        slots.dtype is _I32
        and pages.dtype is _I32
        and req_to_token.dtype is _I32
        and seq_lens.dtype is _I32
        and req_pool_indices.dtype in _INDEX
        and slots.dim() == 2
        and pages.dim() == 2
        and req_to_token.dim() == 2
        and seq_lens.dim() == 1
        and req_pool_indices.dim() == 1
        and slots.is_contiguous()
        and pages.is_contiguous()
        and req_to_token.is_contiguous()
        and seq_lens.is_contiguous()
        and req_pool_indices.is_contiguous()
        and pages.device == device
        and req_to_token.device == device
        and seq_lens.device == device
        and req_pool_indices.device == device
        and pages.shape[0] == reqs
        and seq_lens.shape[0] == reqs
        and req_pool_indices.shape[0] == reqs
        and type(page_size) is int
        and 1 <= page_size <= ref._I32_MAX
    )


def _operands(outs: tuple, args: tuple, params: tuple) -> tuple:
    """``planner.fusion``'s arguments unpacked: the slots, the page table, the token table,
    the request indices, the lengths, the page size and the page table's input."""
    slots, pages = outs
    (req_to_token, req_pool_indices, seq_lens), (page_input,) = args
    return (
        slots,
        pages,
        req_to_token,
        req_pool_indices,
        seq_lens,
        params[1]["page_size"],
        page_input,
    )


def _empty(slots: torch.Tensor, pages: torch.Tensor) -> bool:
    """Whether there is nothing to write (no rows, or rows of no columns in either table)."""
    return slots.shape[0] == 0 or (slots.shape[1] == 0 and pages.shape[1] == 0)


def token_table(
    outs: tuple[torch.Tensor, torch.Tensor],
    args: tuple[tuple, tuple],
    params: tuple[Mapping[str, Any], Mapping[str, Any]],
) -> None:
    """``planner.fusion``'s call: ``outs`` the slots and the page table, ``args`` and
    ``params`` each step's own (the page table's one input is the slots)."""
    slots, pages, req_to_token, req_pool_indices, seq_lens, page_size, page_input = _operands(
        outs, args, params
    )
    if page_input is not slots:
        raise ValueError("the fused page table must read the slots this launch writes")
    plain = _plainly_valid(slots, pages, req_to_token, req_pool_indices, seq_lens, page_size)
    if not plain:
        # the references' own checks name what is wrong (and accept what the test above
        # is too strict for)
        ref.check_gather_token_slots(slots, req_to_token, req_pool_indices, seq_lens)
        ref.check_page_table_from_slots(pages, slots, page_size)
    if slots.device.type != "cuda":
        _require(slots.device)  # the interpreter's CPU tensors, or a refusal
    if _empty(slots, pages):
        return
    grid, args, constexprs = launch_args(
        slots, pages, req_to_token, req_pool_indices, seq_lens, page_size, contiguous=plain
    )
    _token_table.launch_as(known_kinds(args) if plain else None, grid, args, constexprs)


def token_table_launch(
    outs: tuple[torch.Tensor, torch.Tensor],
    args: tuple[tuple, tuple],
    params: tuple[Mapping[str, Any], Mapping[str, Any]],
) -> KernelLaunch | None:
    """The launch :func:`token_table` makes of these arguments, once compiled (``Fusion``'s
    ``launch_of``); None for any case it does not launch directly and plainly: CPU or
    empty tables, arguments the plain check does not pass, a size needing 64 bits."""
    slots, pages, req_to_token, req_pool_indices, seq_lens, page_size, page_input = _operands(
        outs, args, params
    )
    if page_input is not slots or slots.device.type != "cuda" or _empty(slots, pages):
        return None
    if not _plainly_valid(slots, pages, req_to_token, req_pool_indices, seq_lens, page_size):
        return None
    grid, largs, constexprs = launch_args(
        slots, pages, req_to_token, req_pool_indices, seq_lens, page_size, contiguous=True
    )
    kinds = known_kinds(largs)
    return None if kinds is None else _token_table.prepared(kinds, grid, largs, constexprs)


def known_kinds(args: tuple) -> tuple | None:
    """The direct launch's key of ``launch_args``' arguments once ``_plainly_valid`` held:
    int32 tensors but the request indices (int32 or int64), and each size's width; None
    where a size needs 64 bits (the launch then works the kinds out itself)."""
    sizes = args[5:]
    if max(sizes) > ref._I32_MAX or min(sizes) < 0:
        return None
    return (_I32, _I32, _I32, args[3].dtype, _I32, *[32] * len(sizes))


def launch_args(
    slots: torch.Tensor,
    pages: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    contiguous: bool = False,
) -> tuple[tuple[int, int], tuple, dict[str, int]]:
    """The kernel's grid, positional arguments and constexprs for checked, non-empty tables
    (``benchmarks/eager_pieces`` launches it the same way through other paths); the row
    strides are the rows' lengths where the tables are known ``contiguous`` (a table of one
    row or none of its columns may say otherwise, but no row offset of it is then taken)."""
    reqs, width = slots.shape
    n_pages = pages.shape[1]
    ctx = req_to_token.shape[1]
    block = block_size(width)
    page_block = block_size(n_pages)
    grid = (max(-(-width // block), -(-n_pages // page_block)), reqs)
    args = (slots, pages, req_to_token, req_pool_indices, seq_lens, width, ctx, n_pages, page_size)
    if contiguous:
        args += (width, n_pages, ctx)
    else:
        args += (slots.stride(0), pages.stride(0), req_to_token.stride(0))
    return grid, args, {"BLOCK": block, "PAGE_BLOCK": page_block}
