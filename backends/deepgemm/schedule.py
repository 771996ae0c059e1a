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

The reference below is a handful of vectorised tensor ops (cumsum, searchsorted), so it
runs on the CPU and on CUDA, performs no host synchronisation and can be captured in a
CUDA graph.
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import torch

from planner.errors import PlanError, ProviderError

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
    "schedule_numpy",
    "get_paged_mqa_logits_metadata",
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
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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
            "deep_gemm 0.1.0 on Hopper supports only 64-token blocks",
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


def schedule_numpy(out: np.ndarray, last_lens: np.ndarray, num_sms: int, layout: str) -> None:
    """:func:`_compute` over numpy arrays, into int32 ``out [num_sms + 1, 2]``: the host twin
    eager plans use (``last_lens`` is ``context_lens[:, -1]``, already validated)."""
    batch = last_lens.shape[0]
    # the exclusive prefix sum of each request's splits, its first entry 0
    exclusive = np.empty(batch + 1, dtype=np.int64)
    exclusive[0] = 0
    np.cumsum((last_lens + np.int64(SPLIT_KV - 1)) // SPLIT_KV, out=exclusive[1:])
    q, r = divmod(int(exclusive[batch]), num_sms)
    sm = _sm_ramp(num_sms)
    if layout == "0.1.0":
        starts = sm * q + np.minimum(sm, r)
    else:
        starts = sm * q + np.maximum(sm - (num_sms - r), 0)
    req = np.searchsorted(exclusive[1:], starts, side="right")
    if layout == "new":
        np.minimum(req, batch - 1, out=req)
    out[:, 0] = req
    np.subtract(starts, exclusive[req], out=out[:, 1], casting="unsafe")
    if layout == "new":
        out[-1] = (batch, 0)


_SM_RAMPS: dict[int, np.ndarray] = {}


def _sm_ramp(num_sms: int) -> np.ndarray:
    """``arange(num_sms + 1)`` as int64, kept per SM count (one per planner)."""
    ramp = _SM_RAMPS.get(num_sms)
    if ramp is None:
        ramp = _SM_RAMPS[num_sms] = np.arange(num_sms + 1, dtype=np.int64)
    return ramp


def reference_paged_mqa_schedule(
    context_lens: torch.Tensor,
    block_kv: int = BLOCK_KV,
    num_sms: int = 132,
    layout: Layout = "0.1.0",
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Exact PyTorch twin of ``deep_gemm.get_paged_mqa_logits_metadata``.

    ``layout="0.1.0"`` reproduces sgl-deep-gemm 0.1.0 (remainder splits on the first SMs);
    ``layout="new"`` reproduces the mid-2026-onward DeepGEMM builds (remainder on the last
    SMs). Returns a new int32 ``[num_sms + 1, 2]`` tensor on ``context_lens.device``: row
    ``s`` is the (request, 256-token split) where SM ``s`` starts, row ``num_sms`` is the
    end ``(batch, 0)``.
    """
    validate_context_lens(context_lens, check_values=check_values)
    _validate_block_kv(block_kv)
    num_sms = _validate_num_sms(num_sms)
    _validate_layout(layout)
    return _compute(context_lens, num_sms, layout).to(torch.int32)


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
    *,
    layout: Layout = "0.1.0",
    backend: Literal["auto", "native", "reference"] = "auto",
) -> torch.Tensor:
    """Drop-in for ``deep_gemm.get_paged_mqa_logits_metadata``.

    ``backend="auto"`` calls the real kernel when ``context_lens`` is on CUDA, deep_gemm
    imports and its build uses the requested ``layout``; otherwise the exact reference.
    ``"native"`` insists on the real kernel (``ProviderError`` if impossible),
    ``"reference"`` never uses it. Inputs are validated the same way on every path.
    """
    global _warned_layout_mismatch
    validate_context_lens(context_lens)
    _validate_block_kv(block_kv)
    num_sms = _validate_num_sms(num_sms)
    _validate_layout(layout)
    _native.validate_backend(backend)
    if backend != "reference" and context_lens.is_cuda:
        dg = _native.load()
        native_layout = _native.native_schedule_layout() if dg is not None else None
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
    return _compute(context_lens, num_sms, layout).to(torch.int32)
