"""Grouped GEMM for the routed MoE: ``out[m] = a[m] @ b[g]`` for the rows ``m`` of group ``g``.

Groups are contiguous row ranges given by cumulative ends (``ends[g]`` is one past the
last row of group ``g``, int32, like ``torch._grouped_mm``'s ``offs``). Three providers,
all without host syncs and with shapes that depend on the inputs' shapes only:

* ``"triton"``: ``grouped_gemm_triton``, chosen on any CUDA device with Triton: on the
  H200 it beat ``torch._grouped_mm`` at every row count measured, 1 to 128 rows, in
  both MoE shapes (``python -m benchmarks moe_topk``, docs/benchmarks.md).
* ``"torch"``: ``torch._grouped_mm``, CUTLASS on sm90/sm100 for bf16, the choice where
  Triton is missing. Anywhere else torch falls back to a loop that copies ``offs`` to
  the host (a sync, which breaks graph capture), so it is chosen only where that fast
  path exists.
* ``"loop"``: one matmul per group over a fixed window of ``capacity`` rows starting at
  the group's first row, masked. Static shapes on any device; ``groups * capacity``
  rows of work, fine for the CPU (tests, tiny configs) only.

``reference_grouped_mm`` is the slow obvious version (host loop) the providers are
tested against.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from dsv32_engine.models.layers.exact import accumulate_dtype
from dsv32_engine.models.layers.grouped_gemm_triton import grouped_mm_triton
from planner.errors import PlanError

__all__ = [
    "PROVIDERS",
    "grouped_mm",
    "grouped_mm_loop",
    "grouped_mm_provider",
    "reference_grouped_mm",
    "torch_grouped_mm_ok",
]

PROVIDERS = ("torch", "triton", "loop")
_FAST_ARCHS = (9, 10)  # sm90 / sm100: where torch._grouped_mm has a sync-free bf16 kernel


def _check(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise PlanError(
            "grouped GEMM needs a [M, K] and b [G, K, N]",
            field="b",
            expected=f"[G, {a.shape[-1]}, N]",
            actual=f"a {tuple(a.shape)}, b {tuple(b.shape)}",
        )
    if a.dtype != b.dtype:
        raise PlanError("a and b dtypes differ", field="b", expected=a.dtype, actual=b.dtype)
    if ends.dtype != torch.int32 or tuple(ends.shape) != (b.shape[0],):
        raise PlanError(
            "ends must be int32 [groups]",
            field="ends",
            expected=f"int32 [{b.shape[0]}]",
            actual=f"{ends.dtype} {tuple(ends.shape)}",
        )
    if not (a.device == b.device == ends.device):
        raise PlanError(
            "a, b and ends must share a device",
            field="ends",
            expected=str(a.device),
            actual=f"b on {b.device}, ends on {ends.device}",
        )


def _aligned_matrix(t: torch.Tensor) -> bool:
    # One unit-stride dim of the last two, the other a multiple of 16 bytes (TMA's rule).
    unit = 16 // t.element_size()
    s_rows, s_cols = t.stride(-2), t.stride(-1)
    rows, cols = t.shape[-2], t.shape[-1]
    if t.data_ptr() % 16:
        return False
    if s_cols == 1 and s_rows >= max(1, cols):
        return s_rows % unit == 0
    if s_rows == 1 and s_cols >= max(1, rows):
        return s_cols % unit == 0
    return False


def torch_grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes its sync-free CUTLASS path for these inputs.

    Decided from dtype, device capability and layout (metadata only): bf16 on sm90 or
    sm100 with 16-byte aligned strides. Everything else would hit torch's host loop.
    """
    if not hasattr(torch, "_grouped_mm") or a.device.type != "cuda":
        return False
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(a.device)[0] not in _FAST_ARCHS:
        return False
    return _aligned_matrix(a) and _aligned_matrix(b)


def grouped_mm_provider(a: torch.Tensor, b: torch.Tensor) -> str:
    """The provider ``grouped_mm`` picks: shape/dtype/device only, so capture and replay agree."""
    if a.device.type == "cuda" and triton_available(a.device):
        return "triton"
    if torch_grouped_mm_ok(a, b):
        return "torch"
    return "loop"


def grouped_mm_loop(
    a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, capacity: int | None = None
) -> torch.Tensor:
    """The static-shaped fallback: every group's product over all rows, each row keeping its own.

    ``groups`` full products instead of one grouped one: fine at the CPU sizes it
    serves (tests, tiny configs), and branch-free (no gathers or scatters whose
    cost grows with the rows). ``capacity`` is accepted for the other providers'
    signature and ignored. On the CPU each product accumulates in float64 (see
    ``models.layers.exact``), so a row's result does not depend on the batch.
    """
    m = a.shape[0]
    out = torch.zeros(m, b.shape[2], dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    group = torch.searchsorted(ends.to(torch.int64), torch.arange(m, device=a.device), right=True)
    acc = accumulate_dtype(a)
    wide = a.to(acc)
    for g in range(b.shape[0]):
        y = (wide @ b[g].to(acc)).to(a.dtype)
        out = torch.where((group == g).unsqueeze(1), y, out)
    return out


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    ends: torch.Tensor,
    *,
    capacity: int | None = None,
    provider: str | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """``a [M, K]`` by groups of rows times ``b [G, K, N]`` (any strides), in ``a``'s dtype.

    Rows at or past ``ends[-1]`` come back unspecified. ``provider`` forces one of
    ``PROVIDERS``; ``capacity`` (max rows of any group) only matters to ``"loop"``;
    ``block_rows`` (``"triton"`` only) fixes its rows per tile (the batch-invariant mode).
    """
    _check(a, b, ends)
    provider = provider or grouped_mm_provider(a, b)
    if provider == "torch":
        return torch._grouped_mm(a, b, ends)
    if provider == "triton":
        return grouped_mm_triton(a, b, ends, block_rows=block_rows)
    if provider == "loop":
        return grouped_mm_loop(a, b, ends, capacity)
    raise PlanError(
        "unknown grouped GEMM provider", field="provider", expected=PROVIDERS, actual=provider
    )


def reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Test oracle: slices by host-read ends (a sync), fp32 products; zero past ``ends[-1]``."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = a[start:end].float() @ b[g].float()
        start = end
    return out
