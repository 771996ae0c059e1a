"""The SM work schedule of deep_gemm's paged MQA logits kernel, and an exact reference.

What the schedule is (read from the metadata kernel that sgl-deep-gemm 0.1.0 ships,
``deep_gemm/include/deep_gemm/scheduler/paged_mqa_logits.cuh``, and its host side in
``csrc/apis/attention.hpp`` / ``csrc/jit_kernels/impls/smxx_fp8_fp4_paged_mqa_logits.hpp``):

* The unit of work is one request (not one query row) times one KV split of
  ``SPLIT_KV = 256`` tokens (a host constant, independent of ``block_kv``; on Hopper it is
  4 blocks of 64, one per math warpgroup). Request ``b`` has
  ``ceil(context_lens[b, next_n - 1] / 256)`` units: only the LAST column of the 2-D
  ``[batch, next_n]`` lengths is read, and both query rows of an MTP request (next_n = 2)
  are computed together over that length.
* Units are laid out request-major and cut into ``num_sms`` contiguous ranges whose sizes
  differ by at most one: ``q, r = divmod(total, num_sms)``. Row ``s`` of the result is the
  (request, split) where SM ``s`` starts, row ``num_sms`` is ``(batch, 0)``, the end.
* sgl-deep-gemm 0.1.0 gives the ``r`` larger ranges to the FIRST SMs:
  ``start(s) = s * q + min(s, r)``. Builds from mid-2026 on (deepseek-ai/DeepGEMM after the
  "reversed allocation" change) give them to the LAST SMs:
  ``start(s) = s * q + max(0, s - (num_sms - r))``, and clamp the request index of an SM
  below ``num_sms`` to ``batch - 1``. ``layout="0.1.0"`` and ``layout="new"`` reproduce
  each bit for bit.
* The start is located by ``(request, split) = (i, start - prefix[i - 1])`` where ``i`` is
  the number of inclusive prefix sums ``<= start`` (an upper-bound binary search).

Varlen mode (``indices=``, sgl-deep-gemm 0.1.0's ``kIsVarlen`` branch of the same kernel;
the 0.1.0 host accepts it only on SM100, with ``next_n == 1`` and 32- or 64-token blocks):
each row of ``context_lens [tokens, 1]`` is one query token and ``indices[t]`` names the
sequence token ``t`` belongs to. Scanning left to right, token ``t`` and ``t + 1`` form one
work item (an "atom") when ``indices[t] == indices[t + 1]``, and the scan then resumes at
``t + 2``; otherwise ``t`` is an atom alone. An atom's KV length is its LAST token's length
(``context_lens[t + 1]`` for a pair), its units ``ceil(length / 256)``; the SMs are cut as
above (0.1.0's first-SM remainder rule) over atoms, and row ``s`` holds the atom's first
TOKEN index and the split; the end row is ``(tokens, 0)``. The logits kernel computes both
tokens of a pair over the pair's length through the block-table row of the FIRST token.

The reference below is a handful of vectorised tensor ops (cumsum, searchsorted), so it
runs on the CPU and on CUDA, performs no host synchronisation and can be captured in a
CUDA graph. The varlen reference works in token space (a pair's second token carries zero
units), which gives the kernel's atom-space search bit for bit without compacting atoms
(a data-dependent shape).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from planner.errors import PlanError, ProviderError
from planner.ops import capture_guarded

from . import _native
from .fp8 import PAGE

__all__ = [
    "SPLIT_KV",
    "BLOCK_KV",
    "LAYOUTS",
    "Layout",
    "validate_context_lens",
    "schedule_units",
    "reference_paged_mqa_schedule",
    "paged_mqa_schedule_into",
    "get_paged_mqa_logits_metadata",
    "validate_indices",
    "varlen_atom_starts",
    "varlen_block_rows",
]

SPLIT_KV = 256
"""Tokens per schedule unit (``constexpr int split_kv = 256`` in the 0.1.0 host code)."""

BLOCK_KV = PAGE
"""The only page size deep_gemm 0.1.0 accepts on Hopper: the index cache's page (``fp8.PAGE``)."""

LAYOUTS = ("0.1.0", "new")
Layout = Literal["0.1.0", "new"]
_NEXT_N = (1, 2)

_warned_layout_mismatch = False


def _capturing(t: torch.Tensor) -> bool:
    """Under a graph capture: a CUDA one, or the CPU's emulated one (whose guard refuses the
    value checks' host reads, which a GPU's capture skips)."""
    return (t.is_cuda and torch.cuda.is_current_stream_capturing()) or capture_guarded()


def validate_context_lens(context_lens: object, *, check_values: bool = True) -> None:
    """Reject lengths deep_gemm 0.1.0 would reject, and those it would mis-handle.

    Shape and dtype rules are deep_gemm's own (int32, contiguous, 2-D ``[batch, next_n]``,
    next_n 1 or 2). The value rules are ours: every length must be >= 1 (upstream reads
    out of bounds on all-zero lengths, and a planner pads requests to length >= next_n, so
    a zero is always a bug; deep_gemm itself would accept a zero outside the last column),
    and no row may be longer than its request's last column, because the kernel computes
    only up to the last column's length, so a longer row would get garbage inside its
    valid range.

    Value checks read the data: on CUDA that is a host sync, so they are skipped while a
    CUDA graph is being captured (and can be turned off with ``check_values=False``).
    """
    if not isinstance(context_lens, torch.Tensor):
        raise PlanError(
            "must be a tensor",
            field="context_lens",
            expected="torch.Tensor",
            actual=type(context_lens).__name__,
        )
    if context_lens.dtype != torch.int32:
        raise PlanError(
            "must be int32", field="context_lens", expected=torch.int32, actual=context_lens.dtype
        )
    if context_lens.dim() != 2:
        raise PlanError(
            "must be 2-D [batch, next_n]",
            field="context_lens",
            expected="2 dims",
            actual=tuple(context_lens.shape),
        )
    if not context_lens.is_contiguous():
        raise PlanError(
            "must be contiguous",
            field="context_lens",
            expected="contiguous",
            actual=tuple(context_lens.stride()),
        )
    batch, next_n = context_lens.shape
    if next_n not in _NEXT_N:
        raise PlanError(
            "next_n must be 1 or 2", field="context_lens", expected=_NEXT_N, actual=next_n
        )
    if batch < 1:
        raise PlanError(
            "empty batch (deep_gemm cannot compile it)",
            field="context_lens",
            expected="batch >= 1",
            actual=batch,
        )
    if not check_values or _capturing(context_lens):
        return
    bad = int((context_lens <= 0).sum())
    if bad:
        raise PlanError(
            "every length must be >= 1 (upstream reads out of bounds on zero lengths)",
            field="context_lens",
            expected=">= 1",
            actual=f"{bad} entr{'y' if bad == 1 else 'ies'}, min {int(context_lens.min())}",
        )
    if next_n > 1 and bool((context_lens > context_lens[:, -1:]).any()):
        raise PlanError(
            "a row is longer than its request's last column, which deep_gemm computes up to",
            field="context_lens",
            expected="context_lens[:, i] <= context_lens[:, -1]",
            actual="longer row",
        )


def _validate_block_kv(block_kv: object) -> None:
    if block_kv != BLOCK_KV or isinstance(block_kv, bool):
        raise PlanError(
            "the references support only 64-token blocks (all deep_gemm 0.1.0 takes on "
            "Hopper; its SM100-only 32-token blocks are refused)",
            field="block_kv",
            expected=BLOCK_KV,
            actual=block_kv,
        )


def _validate_num_sms(num_sms: object) -> int:
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise PlanError("must be a positive int", field="num_sms", expected=">= 1", actual=num_sms)
    return num_sms


def _validate_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise PlanError("unknown schedule layout", field="layout", expected=LAYOUTS, actual=layout)


def validate_indices(
    indices: object, context_lens: torch.Tensor, *, check_values: bool = True
) -> torch.Tensor:
    """The varlen ``indices=`` checks of 0.1.0's host code, then ours; returns ``indices``.

    0.1.0: int32, 1-D ``[tokens]`` (``context_lens.shape[0]``), contiguous, ``next_n == 1``.
    Ours, on values (CPU or outside capture, like :func:`validate_context_lens`): the first
    token of a pair may not be longer than the second, since the kernel computes the pair
    only up to the second's length.
    """
    if not isinstance(indices, torch.Tensor):
        raise PlanError(
            "must be a tensor or None",
            field="indices",
            expected="torch.Tensor",
            actual=type(indices).__name__,
        )
    if indices.dtype != torch.int32:
        raise PlanError(
            "must be int32", field="indices", expected=torch.int32, actual=indices.dtype
        )
    tokens, next_n = context_lens.shape
    if next_n != 1:
        raise PlanError(
            "varlen (indices=) needs next_n == 1: one context length per token",
            field="indices",
            expected="context_lens [tokens, 1]",
            actual=tuple(context_lens.shape),
        )
    if indices.dim() != 1 or indices.shape[0] != tokens:
        raise PlanError(
            "must be 1-D [tokens] like context_lens' rows",
            field="indices",
            expected=(tokens,),
            actual=tuple(indices.shape),
        )
    if not indices.is_contiguous():
        raise PlanError(
            "must be contiguous", field="indices", expected="contiguous", actual=indices.stride()
        )
    if indices.device != context_lens.device:
        raise PlanError(
            "must live with context_lens",
            field="indices",
            expected=context_lens.device,
            actual=indices.device,
        )
    if check_values and not _capturing(indices) and tokens > 1:
        starts = varlen_atom_starts(indices)
        lens = context_lens[:, 0]
        paired = starts[:-1] & ~starts[1:]
        if bool((paired & (lens[:-1] > lens[1:])).any()):
            raise PlanError(
                "the first token of a pair is longer than the second, which deep_gemm "
                "computes the pair up to",
                field="context_lens",
                expected="context_lens[t] <= context_lens[t + 1] when indices[t] == indices[t + 1]",
                actual="longer first token",
            )
    return indices


def varlen_atom_starts(indices: torch.Tensor) -> torch.Tensor:
    """bool ``[tokens]``: which tokens start an atom of the varlen scan (see the module doc).

    Inside a run of equal consecutive ``indices`` the scan pairs tokens from the run's start,
    so a token starts an atom exactly when its offset in the run is even.
    """
    tokens = indices.shape[0]
    pos = torch.arange(tokens, device=indices.device)
    new_run = torch.ones(tokens, dtype=torch.bool, device=indices.device)
    new_run[1:] = indices[1:] != indices[:-1]
    run_start = torch.cummax(torch.where(new_run, pos, torch.zeros_like(pos)), 0).values
    return (pos - run_start) % 2 == 0


def varlen_block_rows(indices: torch.Tensor) -> torch.Tensor:
    """int64 ``[tokens]``: the block-table row the logits kernel reads for each token (its
    atom's first token)."""
    pos = torch.arange(indices.shape[0], device=indices.device)
    return torch.where(varlen_atom_starts(indices), pos, pos - 1)


def _compute_varlen(
    context_lens: torch.Tensor, indices: torch.Tensor, num_sms: int
) -> torch.Tensor:
    """The 0.1.0 varlen schedule as int64 ``[num_sms + 1, 2]``; inputs already validated."""
    device = context_lens.device
    lens = context_lens[:, 0].to(torch.int64)
    starts = varlen_atom_starts(indices)
    paired = torch.zeros_like(starts)
    paired[:-1] = starts[:-1] & ~starts[1:]
    atom_len = lens.clone()
    atom_len[:-1] = torch.where(paired[:-1], lens[1:], lens[:-1])
    units = torch.where(
        starts, torch.div(atom_len + (SPLIT_KV - 1), SPLIT_KV, rounding_mode="floor"), 0
    )
    prefix = torch.cumsum(units, 0)
    total = prefix[-1]
    q = torch.div(total, num_sms, rounding_mode="floor")
    r = total - q * num_sms
    sm = torch.arange(num_sms + 1, device=device, dtype=torch.int64)
    seg = sm * q + torch.minimum(sm, r)
    # Tokens whose prefix is <= seg: past every atom the kernel's search counts, so this
    # lands on the first token of the atom it finds (or on `tokens`, the end).
    tok = torch.searchsorted(prefix, seg, right=True)
    exclusive = torch.cat([prefix.new_zeros(1), prefix])
    return torch.stack([tok, seg - exclusive[tok]], dim=1)


def schedule_units(context_lens: torch.Tensor) -> torch.Tensor:
    """Work units per request: ``ceil(context_lens[:, -1] / 256)`` as int64 ``[batch]``."""
    last = context_lens[:, -1].to(torch.int64)
    return torch.div(last + (SPLIT_KV - 1), SPLIT_KV, rounding_mode="floor")


def _compute(context_lens: torch.Tensor, num_sms: int, layout: str) -> torch.Tensor:
    """The schedule as int64 ``[num_sms + 1, 2]``; inputs already validated."""
    device = context_lens.device
    batch = context_lens.shape[0]
    units = schedule_units(context_lens)
    prefix = torch.cumsum(units, 0)  # inclusive, non-decreasing
    total = prefix[-1]
    q = torch.div(total, num_sms, rounding_mode="floor")
    r = total - q * num_sms
    sm = torch.arange(num_sms + 1, device=device, dtype=torch.int64)
    if layout == "0.1.0":
        starts = sm * q + torch.minimum(sm, r)
    else:
        pivot = num_sms - r
        starts = sm * q + torch.clamp(sm - pivot, min=0)
    # Number of inclusive prefix sums <= start == the kernel's upper-bound binary search.
    req = torch.searchsorted(prefix, starts, right=True)
    if layout == "new":
        req = torch.clamp(req, max=batch - 1)
    exclusive = torch.cat([prefix.new_zeros(1), prefix])
    split = starts - exclusive[req]
    if layout == "new":
        # The end row is written explicitly as (batch, 0) by newer builds.
        req = torch.cat([req[:-1], req.new_full((1,), batch)])
        split = torch.cat([split[:-1], split.new_zeros(1)])
    return torch.stack([req, split], dim=1)


def reference_paged_mqa_schedule(
    context_lens: torch.Tensor,
    block_kv: int = BLOCK_KV,
    num_sms: int = 132,
    layout: Layout = "0.1.0",
    *,
    indices: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Exact PyTorch twin of ``deep_gemm.get_paged_mqa_logits_metadata``.

    ``layout="0.1.0"`` reproduces sgl-deep-gemm 0.1.0 (remainder splits on the first SMs);
    ``layout="new"`` reproduces the mid-2026-onward DeepGEMM builds (remainder on the last
    SMs). Returns a new int32 ``[num_sms + 1, 2]`` tensor on ``context_lens.device``: row
    ``s`` is the (request, 256-token split) where SM ``s`` starts, row ``num_sms`` is the
    end ``(batch, 0)``. ``indices`` selects 0.1.0's varlen schedule (module doc); it exists
    only for ``layout="0.1.0"``.
    """
    validate_context_lens(context_lens, check_values=check_values)
    _validate_block_kv(block_kv)
    num_sms = _validate_num_sms(num_sms)
    _validate_layout(layout)
    if indices is not None:
        _validate_varlen_layout(layout)
        validate_indices(indices, context_lens, check_values=check_values)
        return _compute_varlen(context_lens, indices, num_sms).to(torch.int32)
    return _compute(context_lens, num_sms, layout).to(torch.int32)


def _validate_varlen_layout(layout: str) -> None:
    if layout != "0.1.0":
        raise PlanError(
            "the varlen schedule (indices=) is reproduced for sgl-deep-gemm 0.1.0 only",
            field="indices",
            expected="layout '0.1.0'",
            actual=f"layout {layout!r}",
        )


def paged_mqa_schedule_into(
    out: torch.Tensor,
    context_lens_2d: torch.Tensor,
    block_kv: int,
    num_sms: int,
    layout: Layout = "0.1.0",
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Write the reference schedule into ``out`` (int32 ``[num_sms + 1, 2]``) and return it.

    The in-place form is what a planner's metadata op needs: a static buffer that CUDA-graph
    replays read, refilled each batch without allocating. Same semantics as
    :func:`reference_paged_mqa_schedule`.
    """
    validate_context_lens(context_lens_2d, check_values=check_values)
    _validate_block_kv(block_kv)
    num_sms = _validate_num_sms(num_sms)
    _validate_layout(layout)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32:
        raise PlanError(
            "must be an int32 tensor",
            field="out",
            expected=torch.int32,
            actual=getattr(out, "dtype", type(out).__name__),
        )
    if tuple(out.shape) != (num_sms + 1, 2):
        raise PlanError(
            "wrong shape", field="out", expected=(num_sms + 1, 2), actual=tuple(out.shape)
        )
    if out.device != context_lens_2d.device:
        raise PlanError(
            "must live with context_lens",
            field="out",
            expected=context_lens_2d.device,
            actual=out.device,
        )
    out.copy_(_compute(context_lens_2d, num_sms, layout))
    return out


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_kv: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
    *,
    layout: Layout = "0.1.0",
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.get_paged_mqa_logits_metadata`` (sgl-deep-gemm 0.1.0).

    ``backend="auto"`` calls the real kernel when ``context_lens`` is on CUDA, deep_gemm
    imports and its build uses the requested ``layout``; otherwise the exact reference.
    ``"native"`` insists on the real kernel (``ProviderError`` if impossible),
    ``"reference"`` never uses it. Inputs are validated the same way on every path.

    ``indices`` (varlen, one context length per token; see the module doc) runs on the real
    kernel only where 0.1.0 runs it, SM100 (compute capability 10.x); elsewhere ``"auto"``
    computes it with the reference on the tensors' device and ``"native"`` refuses.
    """
    global _warned_layout_mismatch
    validate_context_lens(context_lens)
    _validate_block_kv(block_kv)
    num_sms = _validate_num_sms(num_sms)
    _validate_layout(layout)
    _native.validate_backend(backend)
    if indices is not None:
        _validate_varlen_layout(layout)
        validate_indices(indices, context_lens)
    if backend != "reference" and context_lens.is_cuda:
        dg = _native.load()
        native_layout = _native.native_schedule_layout() if dg is not None else None
        if indices is not None and dg is not None and native_layout == layout:
            if _native.arch_major(context_lens) == 10:
                return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices)
            if backend == "native":
                raise ProviderError(
                    "deep_gemm 0.1.0 computes the varlen schedule on SM100 only",
                    field="indices",
                    expected="compute capability 10.x, or backend 'auto'/'reference'",
                    actual=f"compute capability {_native.arch_major(context_lens)}.x",
                )
            return _compute_varlen(context_lens, indices, num_sms).to(torch.int32)
        if dg is not None and native_layout == layout:
            return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)
        if backend == "native":
            raise ProviderError(
                "real deep_gemm schedule unavailable for this layout",
                field="backend",
                expected=f"deep_gemm with layout {layout!r}",
                actual="not importable" if dg is None else f"layout {native_layout!r}",
            )
        if dg is not None and not _warned_layout_mismatch:
            _warned_layout_mismatch = True
            warnings.warn(
                f"installed deep_gemm schedules with layout {native_layout!r}, not {layout!r}; "
                "using the reference schedule",
                RuntimeWarning,
                stacklevel=2,
            )
    elif backend == "native":
        raise ProviderError(
            "the real kernel needs CUDA tensors",
            field="backend",
            expected="cuda",
            actual=context_lens.device,
        )
    if indices is not None:
        return _compute_varlen(context_lens, indices, num_sms).to(torch.int32)
    return _compute(context_lens, num_sms, layout).to(torch.int32)
